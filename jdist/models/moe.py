"""Mixtral-style mixture-of-experts MLP: a learned top-k router over E SwiGLU experts.

This module owns the parameters and the arithmetic of one group of tokens (routing,
dispatch into per-expert buffers, expert compute, combine). Expert parallelism wraps
`moe_group` in a `shard_map` with all-to-alls over the expert axis (`jdist.parallel.moe`);
the step passes that in as `ModelContext.moe`.

Routing policies:
- grouped: nothing is dropped, and the experts run the routed FLOPs: assignments are sorted
  by expert into blocks and each block meets its expert's weights (`models.grouped`); with
  expert parallelism tokens travel in bounded rounds (`jdist.parallel.expert_rounds`).
- dropless: nothing is dropped: each (source device, expert) buffer has room for every
  local token, since a token picks an expert at most once. The price is compute on the
  empty slots (E/k times the useful FLOPs).
- capacity: each expert takes at most ceil(factor x tokens x k / E) tokens per group
  (first choices before second choices); overflow is dropped and its token passes
  through the residual stream unchanged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jdist.models.config import ModelConfig
from jdist.models.grouped import grouped_swiglu
from jdist.models.layers import INIT_STD, param, zeros
from jdist.models.precision import accumulator
from jdist.models.remat import EXPERT_EXCHANGE
from jdist.models.routing import within_best_groups
from jdist.spmd.axes import EMBED, EXPERTS, MLP

GROUPED, DROPLESS, CAPACITY = "grouped", "dropless", "capacity"
ROUTER_BIAS = "router_bias"  # the aux-loss-free routing bias, moved by the step, not trained
# gpt-oss's trained biases (ModelConfig.moe_biases): on the router's logits, and each
# expert's on its gate, up and down projections.
EXPERT_BIASES = ("router_b", "b_gate", "b_up", "b_down")
STATS = ("counts", "prob_sum", "z_sum", "tokens", "dropped")  # additive balance statistics
# Name scopes of the expert-parallel exchanges, in the compiled program's op names (their
# autodiff transposes, and `expert_rounds`' own backward, keep their forward's): tokens to
# their experts, outputs back (`jdist.tools.gpu_report.report`'s `only`).
DISPATCH, COMBINE = "moe_dispatch", "moe_combine"


def route(x: jax.Array, router: jax.Array, cfg, bias: jax.Array | None = None,
          logit_bias: jax.Array | None = None):
    """x [T, d] -> (top-k weights [T, k], experts [T, k], probs [T, E], logits [T, E]);
    the weights are the chosen probabilities, renormalised over the k if the config says,
    times `routed_scale`; with expert groups, chosen inside the best groups only
    (`models.routing`).
    A routing `bias` [E] (aux-loss-free balancing) shifts which experts are chosen, never
    what they weigh. A `logit_bias` [E] (gpt-oss's router bias) is part of the logits."""
    acc = accumulator(x)
    logits = x.astype(acc) @ router.astype(acc)
    if logit_bias is not None:
        logits = logits + logit_bias.astype(acc)
    probs = jax.nn.sigmoid(logits) if cfg.gating == "sigmoid" else jax.nn.softmax(logits)
    choice = probs if bias is None else probs + bias
    choice = within_best_groups(choice, cfg.n_expert_groups, cfg.topk_groups)
    experts = jax.lax.top_k(choice, cfg.top_k)[1]
    top = jnp.take_along_axis(probs, experts, axis=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(-1, keepdims=True)
    return top * cfg.routed_scale, experts, probs, logits


def positions_in_experts(experts: jax.Array, n_experts: int) -> jax.Array:
    """Each assignment's slot in its expert's queue: all first choices, then second ..."""
    t, k = experts.shape
    one_hot = jax.nn.one_hot(experts.T.reshape(-1), n_experts, dtype=jnp.int32)  # [k*T, E]
    slots = jnp.cumsum(one_hot, axis=0) - 1
    return jnp.take_along_axis(slots, experts.T.reshape(-1, 1), axis=1).reshape(k, t).T


def gated(a: jax.Array, b: jax.Array, cfg=None) -> jax.Array:
    """The experts' gating of gate `a` and up `b`: silu(a) * b, or with `cfg.swiglu_limit`
    gpt-oss's clamped form (gate clamped above, up on both sides; (up + 1) * glu)."""
    limit = getattr(cfg, "swiglu_limit", 0.0)
    if not limit:
        return jax.nn.silu(a) * b
    a, b = jnp.minimum(a, limit), jnp.clip(b, -limit, limit)
    return (b + 1) * a * jax.nn.sigmoid(cfg.swiglu_alpha * a)


def swiglu(h: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
           fp8=None, cfg=None, biases: dict | None = None) -> jax.Array:
    """Per-expert SwiGLU on buffers h [E, C, d] with weights [E, d, f] / [E, f, d].
    `fp8`: a `jdist.quant.fp8.ExpertDots` (its `padded` matmuls), or None. `biases`: the
    experts' gate and up biases [E, f] (`EXPERT_BIASES`); the down bias is the caller's
    (after any sum over split hidden units)."""
    gate, up, down = (w.astype(h.dtype) for w in (gate, up, down))
    dot = fp8.padded.project if fp8 else jnp.einsum
    a = dot("ecd,edf->ecf", h, gate)
    b = dot("ecd,edf->ecf", h, up)
    if biases:
        a = a + biases["b_gate"].astype(h.dtype)[:, None]
        b = b + biases["b_up"].astype(h.dtype)[:, None]
    return dot("ecf,efd->ecd", gated(a, b, cfg), down)


def capacity_of(tokens: int, cfg, dropless: bool) -> int:
    if dropless:  # an expert gets each token at most once
        return tokens
    return max(1, math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts))


def dispatch(x, experts, slots, capacity: int, n_experts: int) -> jax.Array:
    """Scatter tokens into per-expert buffers [E, capacity, d]; overflow falls off."""
    t, k = experts.shape
    buf = jnp.zeros((n_experts, capacity, x.shape[-1]), x.dtype)
    return buf.at[experts, slots].add(jnp.broadcast_to(x[:, None], (t, k, x.shape[-1])),
                                      mode="drop")


def combine(out, experts, slots, weights, capacity: int) -> jax.Array:
    """Gather each token's expert outputs back and mix them by the router weights."""
    kept = (slots < capacity).astype(out.dtype)
    picked = out.at[experts, slots].get(mode="fill", fill_value=0)  # [T, k, d]
    return jnp.einsum("tkd,tk->td", picked, weights.astype(out.dtype) * kept)


def balance_sums(probs, experts, logits, dropped, n_experts: int) -> dict:
    """Additive statistics of one group: summing them over groups gives the global ones."""
    return {"counts": jax.nn.one_hot(experts, n_experts).sum((0, 1)),
            "prob_sum": probs.sum(0),
            "z_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
            "tokens": jnp.asarray(probs.shape[0], jnp.float32),
            "dropped": jnp.asarray(dropped, jnp.float32)}


def rebalanced_bias(bias: jax.Array, loads: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's aux-loss-free update of the routing biases [layers, E] from one step's
    assignments per expert `loads` [layers, E] (whole global batch): each bias moves by
    `rate` up if its expert took fewer than its layer's mean, down if more. Compared in
    integers as sum - E x load, so the update is the same on every mesh while the float32
    counts it is given are exact: below 2^24 assignments per layer and step."""
    counts = loads.astype(jnp.int32)
    step = jnp.sign(counts.sum(-1, keepdims=True) - loads.shape[-1] * counts)
    return bias + (rate * step).astype(bias.dtype)


def local_experts(x, experts, w, fp8=None, kernel=None) -> jax.Array:
    """Each assignment's expert output [T, k, d], all experts on this device (`kernel`: the
    grouped matmuls' `models.grouped_kernel.Kernel`, or None for the loop)."""
    gate, up, down = (w[k].astype(x.dtype) for k in ("w_gate", "w_up", "w_down"))
    return grouped_swiglu(x, experts, gate, up, down, fp8, kernel)


def grouped_group(x, weights, experts, w, tp_axes=(), experts_run=local_experts):
    """The grouped dropless path for one group: every assignment computed at the routed
    FLOPs by `experts_run` (here, or across expert-parallel devices), mixed by the router."""
    y = jnp.einsum("tkd,tk->td", experts_run(x, experts, w), weights.astype(x.dtype))
    # Hidden units split over tensor: summing the mixed [T, d] moves k times fewer bytes
    # than summing each assignment's output.
    return jax.lax.psum(y, tp_axes) if tp_axes else y


def padded_experts(buf, w, ep_axes=(), tp_axes=(), n_ep: int = 1, fp8=None,
                   cfg=None) -> jax.Array:
    """Buffers [E, C, d] -> the experts' outputs in the same slots: with `ep_axes` the
    buffers travel to their experts' devices and back by all-to-all."""
    capacity = buf.shape[1]
    if n_ep > 1:  # [E, C, d] -> my experts' tokens from every source: [n*E_local, C, d]
        buf = exchange(buf, ep_axes, DISPATCH)
    local = buf.shape[0] // n_ep
    h = buf.reshape(n_ep, local, capacity, -1).swapaxes(0, 1).reshape(local, n_ep * capacity, -1)
    biases = {k: w[k] for k in EXPERT_BIASES if k in w}
    out = swiglu(h, w["w_gate"], w["w_up"], w["w_down"], fp8, cfg, biases)
    if tp_axes:  # expert hidden units are split over tensor: row-parallel down projection
        out = jax.lax.psum(out, tp_axes)
    if biases:  # once per slot, after the sum; weighted by the router in `combine`
        out = out + biases["b_down"].astype(out.dtype)[:, None]
    out = out.reshape(local, n_ep, capacity, -1).swapaxes(0, 1).reshape(n_ep * local, capacity, -1)
    return exchange(out, ep_axes, COMBINE) if n_ep > 1 else out


def exchange(a, ep_axes, scope: str, keep: bool = True):
    """`a` sent to its peers under name scope `scope` (DISPATCH or COMBINE); `keep`: named
    for the remat policies to keep (`remat.EXPERT_EXCHANGE`)."""
    with jax.named_scope(scope):
        out = jax.lax.all_to_all(a, ep_axes, 0, 0, tiled=True)
    return checkpoint_name(out, EXPERT_EXCHANGE) if keep else out


def even_pieces(n: int, pieces: int) -> int:
    """The most pieces, up to `pieces`, that split `n` slots or tokens evenly."""
    return max(p for p in range(1, pieces + 1) if n % p == 0)


def moe_group(x, w, cfg, ep_axes=(), tp_axes=(), n_ep: int = 1, experts_run=local_experts,
              fp8=None, pieces: int = 1):
    """One group of tokens x [T, d] through the MoE; returns (y [T, d], balance sums).
    With `ep_axes` (inside a shard_map over them) each device holds E/n_ep experts and
    tokens travel to their experts' devices and back by all-to-all; with `tp_axes` the
    experts' hidden units are split and the down projection is summed over them. Grouped
    routing runs its experts with `experts_run` (the expert-parallel kernel passes its own);
    the padded routings run theirs in FP8 with `fp8` (a `jdist.quant.fp8.ExpertDots`), their
    buffers' slots in up to `pieces` independent exchanges (each slot is computed alone, so
    the same function) that the GPU scheduler overlaps with each other's matmuls."""
    n_experts = cfg.n_experts
    weights, experts, probs, logits = route(x, w["router"], cfg, w.get(ROUTER_BIAS),
                                            w.get(EXPERT_BIASES[0]))
    if cfg.moe_routing == GROUPED:
        return (grouped_group(x, weights, experts, w, tp_axes, experts_run),
                balance_sums(probs, experts, logits, 0, n_experts))
    dropless = cfg.moe_routing == DROPLESS
    capacity = capacity_of(x.shape[0], cfg, dropless)
    slots = positions_in_experts(experts, n_experts)
    buf = dispatch(x, experts, slots, capacity, n_experts)
    parts = jnp.split(buf, even_pieces(capacity, pieces), axis=1)
    out = jnp.concatenate([padded_experts(b, w, ep_axes, tp_axes, n_ep, fp8, cfg)
                           for b in parts],
                          axis=1)
    y = combine(out, experts, slots, weights, capacity)
    return y, balance_sums(probs, experts, logits, jnp.sum(slots >= capacity), n_experts)


def local_moe(x: jax.Array, w: dict, cfg):
    """All tokens as one group, on one device: x [B, S, d] -> (y, balance sums)."""
    b, s, d = x.shape
    y, sums = moe_group(x.reshape(b * s, d), w, cfg)
    return y.reshape(b, s, d), sums


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
        out_std = INIT_STD / (2 * cfg.n_layers) ** 0.5
        self.config = cfg
        self.router = param(rngs, (d, e), (EMBED, None))
        self.w_gate = param(rngs, (e, d, f), (EXPERTS, EMBED, MLP))
        self.w_up = param(rngs, (e, d, f), (EXPERTS, EMBED, MLP))
        self.w_down = param(rngs, (e, f, d), (EXPERTS, MLP, EMBED), std=out_std)
        if cfg.router_bias_rate:  # starts at zero: the plain top-k choice
            self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=(None,),
                                         eager_sharding=False)
        if cfg.moe_biases:
            self.router_b = zeros((e,), (None,))
            self.b_gate, self.b_up = zeros((e, f), (EXPERTS, MLP)), zeros((e, f), (EXPERTS, MLP))
            self.b_down = zeros((e, d), (EXPERTS, None))

    def __call__(self, x: jax.Array, ctx) -> tuple[jax.Array, dict]:
        """x [batch, length, d] -> (output, summed load-balancing statistics)."""
        weights = {"router": self.router[...], "w_gate": self.w_gate[...],
                   "w_up": self.w_up[...], "w_down": self.w_down[...]}
        if self.config.router_bias_rate:
            weights[ROUTER_BIAS] = getattr(self, ROUTER_BIAS)[...]
        if self.config.moe_biases:
            weights |= {k: getattr(self, k)[...] for k in EXPERT_BIASES}
        return (ctx.moe or local_moe)(x, weights, self.config)
