"""Mixture-of-experts feed-forward: top-k routing, expert compute, expert parallelism.

Inside a training step the layer runs as one `jax.shard_map` over the whole mesh: each
device routes its own tokens, sends every token to the device that owns its expert with
an all-to-all over the `expert` axis, runs its local experts (hidden units split over
`tensor`), and sends the results back with a second all-to-all. Load-balancing
statistics are summed over every axis that splits tokens, so the auxiliary losses are
the global ones whatever the mesh.

Routing policies:
- dropless: nothing is dropped: each (source device, expert) buffer has room for every
  local token, since a token picks an expert at most once. The price is compute on the
  empty slots (E/k times the useful FLOPs). A grouped matmul (`lax.ragged_dot`) would skip
  them, but jax 0.10 cannot batch it the way the per-replica gradient vmap needs.
- capacity: each expert takes at most ceil(factor x tokens x k / E) tokens per group
  (first choices before second choices); overflow is dropped and its token passes
  through the residual stream unchanged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jdist import axes as ax
from jdist.parallel import kernel_mesh
from jdist.rules import active, mesh_axes_of, resolve

DROPLESS, CAPACITY = "dropless", "capacity"



def route(x: jax.Array, router: jax.Array, cfg):
    """x [T, d] -> (top-k weights [T, k], experts [T, k], probs [T, E], logits [T, E])."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    probs = jax.nn.sigmoid(logits) if cfg.gating == "sigmoid" else jax.nn.softmax(logits)
    top, experts = jax.lax.top_k(probs, cfg.top_k)
    return top / top.sum(-1, keepdims=True), experts, probs, logits


def positions_in_experts(experts: jax.Array, n_experts: int) -> jax.Array:
    """Each assignment's slot in its expert's queue: all first choices, then second ..."""
    t, k = experts.shape
    one_hot = jax.nn.one_hot(experts.T.reshape(-1), n_experts, dtype=jnp.int32)  # [k*T, E]
    slots = jnp.cumsum(one_hot, axis=0) - 1
    return jnp.take_along_axis(slots, experts.T.reshape(-1, 1), axis=1).reshape(k, t).T


def swiglu(h: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Per-expert SwiGLU on buffers h [E, C, d] with weights [E, d, f] / [E, f, d]."""
    a = jnp.einsum("ecd,edf->ecf", h, gate)
    b = jnp.einsum("ecd,edf->ecf", h, up)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(a) * b, down)


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


def balance_sums(probs, experts, logits, slots, capacity: int, n_experts: int) -> dict:
    """Additive statistics of one group: summing them over groups gives the global ones."""
    return {"counts": jax.nn.one_hot(experts, n_experts).sum((0, 1)),
            "prob_sum": probs.sum(0),
            "z_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
            "tokens": jnp.asarray(probs.shape[0], jnp.float32),
            "dropped": jnp.sum(slots >= capacity).astype(jnp.float32)}


def moe_group(x, w, cfg, ep_axes=(), tp_axes=(), n_ep: int = 1):
    """One device's tokens x [T, d] through the MoE; returns (y [T, d], balance sums)."""
    n_experts = cfg.n_experts
    weights, experts, probs, logits = route(x, w["router"], cfg)
    dropless = cfg.moe_routing == DROPLESS
    capacity = capacity_of(x.shape[0], cfg, dropless)
    slots = positions_in_experts(experts, n_experts)
    buf = dispatch(x, experts, slots, capacity, n_experts)
    if n_ep > 1:  # [E, C, d] -> my experts' tokens from every source: [n*E_local, C, d]
        buf = jax.lax.all_to_all(buf, ep_axes, 0, 0, tiled=True)
    local = buf.shape[0] // n_ep
    h = buf.reshape(n_ep, local, capacity, -1).swapaxes(0, 1).reshape(local, n_ep * capacity, -1)
    out = swiglu(h, w["w_gate"], w["w_up"], w["w_down"])
    if tp_axes:  # expert hidden units are split over tensor: row-parallel down projection
        out = jax.lax.psum(out, tp_axes)
    out = out.reshape(local, n_ep, capacity, -1).swapaxes(0, 1).reshape(n_ep * local, capacity, -1)
    if n_ep > 1:
        out = jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)
    y = combine(out, experts, slots, weights, capacity)
    return y, balance_sums(probs, experts, logits, slots, capacity, n_experts)


X_NAMES = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)
AUX_LOSS, Z_LOSS = "moe_aux_loss", "moe_z_loss"  # reported balancing losses (metrics keys)
DROPPED_FRACTION, LOAD_IMBALANCE = "moe_dropped_fraction", "moe_load_imbalance"
WEIGHT_NAMES = {"router": (None, None), "w_gate": (ax.EXPERTS, None, ax.MLP),
                "w_up": (ax.EXPERTS, None, ax.MLP), "w_down": (ax.EXPERTS, ax.MLP, None)}


def moe_ffn(x: jax.Array, w: dict, cfg):
    """x [B, S, d] -> (y [B, S, d], balance sums over all tokens). Outside a training step
    (no mesh) it is plain single-group code; inside, one shard_map over the mesh."""
    b, s, d = x.shape
    context = active()
    if context is None:
        y, sums = moe_group(x.reshape(b * s, d), w, cfg)
        return y.reshape(b, s, d), sums
    mesh, rules = context
    x_spec = resolve(X_NAMES, rules, mesh)
    w_specs = {k: resolve(v, rules, mesh) for k, v in WEIGHT_NAMES.items()}
    token_axes = mesh_axes_of(x_spec[0]) + mesh_axes_of(x_spec[1])
    ep_axes = mesh_axes_of(w_specs["w_gate"][0])
    tp_axes = mesh_axes_of(w_specs["w_gate"][2])
    n_ep = math.prod(mesh.shape[a] for a in ep_axes)

    def kernel(x, w):
        lb, ls, _ = x.shape
        y, sums = moe_group(x.reshape(lb * ls, d), w, cfg, ep_axes, tp_axes, n_ep)
        if token_axes:
            sums = jax.lax.psum(sums, token_axes)
        return y.reshape(lb, ls, d), sums

    sums_spec = {k: P() for k in ("counts", "prob_sum", "z_sum", "tokens", "dropped")}
    return jax.shard_map(kernel, in_specs=(x_spec, w_specs), out_specs=(x_spec, sums_spec),
                         **kernel_mesh(mesh))(x, w)


def moe_losses(local: dict, total: dict, cfg) -> dict:
    """Balancing losses and load metrics from per-layer summed statistics [layers, ...].

    Switch load-balancing loss E * sum_e f_e * P_e (f_e: fraction of assignments to expert
    e, P_e: its mean router probability) and the router z-loss, averaged over layers. f_e
    and the reported values come from `total` (every replica's tokens); P_e and z come
    from `local` (this replica's tokens), so the replicas' objectives average to exactly
    the global losses and the gradients are those of one device."""
    fraction = total["counts"] / (total["tokens"][..., None] * cfg.top_k)

    def aux(stats):
        mean_prob = stats["prob_sum"] / stats["tokens"][..., None]
        return jnp.mean(cfg.n_experts * jnp.sum(fraction * mean_prob, -1))

    counts = total["counts"].sum(0)
    return {"aux_loss_local": aux(local),
            "z_loss_local": jnp.mean(local["z_sum"] / local["tokens"]),
            AUX_LOSS: aux(total),
            Z_LOSS: jnp.mean(total["z_sum"] / total["tokens"]),
            DROPPED_FRACTION: total["dropped"].sum() / (total["tokens"].sum() * cfg.top_k),
            LOAD_IMBALANCE: jnp.max(counts) / jnp.mean(counts)}
