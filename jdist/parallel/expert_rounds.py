"""Grouped dropless experts under expert parallelism: tokens travel in bounded rounds.

Static shapes cannot size a receive buffer to what routing sends (up to every token of every
device to one device). So each device sends each expert-parallel peer at most `capacity`
assignments per round, ROUND_FACTOR x the even share, and rounds repeat until every
assignment has been served: one round when routing is near balance, more (never a drop)
when it is not. Per round, the tokens and their local expert ids go out by all-to-all, the
receiver runs its experts on the rows it got (`models.grouped`: the rows it received,
padded to one-expert blocks), and the outputs come back by a second all-to-all.

The round count depends on the routing, so the rounds after the first are a `while_loop`,
which autodiff cannot reverse. A custom VJP keeps the first round's expert VJP (what plain
autodiff would save) and runs the later rounds again in the backward, recomputing each one's
expert forward: near balance there is no later round and nothing is recomputed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jdist.models.grouped import grouped_swiglu
from jdist.models.moe import COMBINE, DISPATCH, exchange
from jdist.models.precision import accumulator
from jdist.models.remat import EXPERT_EXCHANGE
from jdist.spmd.varying import alike, zeros

ROUND_FACTOR = 1.2  # per-peer room per round over the even share (bytes and FLOPs per round)


def round_capacity(assignments: int, n_ep: int) -> int:
    """Assignments a device sends each peer per round."""
    return max(1, math.ceil(ROUND_FACTOR * assignments / n_ep))


def routed_rounds(x, w, experts, ep_axes: tuple, n_ep: int, fp8=None,
                  kernel=None) -> jax.Array:
    """Every assignment's expert output [T k, d] (partial over `tensor` where the experts'
    hidden units are split). Inside a shard_map over `ep_axes`; w holds the local experts.
    `fp8`: a `jdist.quant.fp8.ExpertDots`, or None; `kernel`: `models.grouped_kernel.Kernel`
    or None (the grouped matmuls' loop)."""
    x, *w = alike(x, *(w[k].astype(x.dtype) for k in ("w_gate", "w_up", "w_down")))
    return _rounds(x, *w, experts, tuple(ep_axes), n_ep, (fp8, kernel))


def _plan(experts, e_local: int, n_ep: int, capacity: int, ep_axes):
    """Sorted assignment order, per-peer counts and starts, and the round count (the same
    on every device of the exchange)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, so by destination
    counts = jnp.zeros(n_ep, jnp.int32).at[flat // e_local].add(1)
    rounds = jax.lax.pmax(jnp.max(-(-counts // capacity)), ep_axes)
    return flat, order, counts, jnp.cumsum(counts) - counts, rounds


def _sent(r, order, counts, starts, capacity: int):
    """Round r's assignment ids [n_ep, capacity] (N where a slot is empty)."""
    slot = r * capacity + jnp.arange(capacity)[None]
    n = order.shape[0]
    picked = order[jnp.clip(starts[:, None] + slot, 0, n - 1)]
    return jnp.where(slot < counts[:, None], picked, n)


def _round_inputs(x, flat, idx, k: int, e_local: int, ep_axes):
    """The rows and local expert ids one round delivers to this device, flattened (named for
    the remat policies to keep: `_rounds_fwd`)."""
    d = x.shape[-1]
    rows = x.at[idx // k].get(mode="fill", fill_value=0)
    ids = flat.at[idx].get(mode="fill", fill_value=0) % e_local
    return exchange(rows, ep_axes, DISPATCH).reshape(-1, d), \
        exchange(ids, ep_axes, DISPATCH).reshape(-1, 1)


def _round_vjp(x, weights, flat, idx, k: int, ep_axes, fp8):
    """The experts' outputs for the rows one round delivers here, and their VJP; `fp8`:
    (`ExpertDots` or None, `Kernel` or None)."""
    rows, ids = _round_inputs(x, flat, idx, k, weights[0].shape[0], ep_axes)
    return jax.vjp(lambda r, *w: grouped_swiglu(r, ids, *w, *fp8), rows, *weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _rounds(x, gate, up, down, experts, ep_axes, n_ep, fp8):
    return _rounds_fwd(x, gate, up, down, experts, ep_axes, n_ep, fp8)[0]


def _round_setup(x, gate, experts, ep_axes, n_ep):
    t, k = experts.shape
    capacity = round_capacity(t * k, n_ep)
    plan = _plan(experts, gate.shape[0], n_ep, capacity, ep_axes)
    return k, capacity, plan


def _rounds_fwd(x, gate, up, down, experts, ep_axes, n_ep, fp8):
    k, capacity, (flat, order, counts, starts, rounds) = \
        _round_setup(x, gate, experts, ep_axes, n_ep)
    d = x.shape[-1]

    def served(r):
        """Round r's ids and its experts' VJP, whose value is the outputs sent back."""
        idx = _sent(r, order, counts, starts, capacity)
        out, vjp = _round_vjp(x, (gate, up, down), flat, idx, k, ep_axes, fp8)
        return idx, exchange(out.reshape(n_ep, capacity, d), ep_axes, COMBINE, False), vjp

    idx, back, first_vjp = served(jnp.zeros((), jnp.int32))
    out = zeros((flat.shape[0], d), x.dtype, like=x).at[idx].add(back, mode="drop")

    def later_round(carry):
        r, out = carry
        idx, back, _ = served(r)
        return r + 1, out.at[idx].add(back, mode="drop")

    _, out = jax.lax.while_loop(lambda c: c[0] < rounds, later_round,
                                (jnp.ones((), jnp.int32), out))
    # With the first round's received rows, what `selective` and `full` keep: a backward
    # recomputing this layer redoes the first round's expert matmuls, no exchange and no
    # later round.
    return checkpoint_name(out, EXPERT_EXCHANGE), (x, gate, up, down, experts, first_vjp)


def _rounds_bwd(ep_axes, n_ep, fp8, res, g):
    x, gate, up, down, experts, first_vjp = res
    k, capacity, (flat, order, counts, starts, rounds) = \
        _round_setup(x, gate, experts, ep_axes, n_ep)
    d = x.shape[-1]

    def backward(r, vjp, dx, dw):
        """Round r's output gradients out, its input gradients back; weight gradients."""
        idx = _sent(r, order, counts, starts, capacity)
        # The transposes of the forward's combine and dispatch, scoped as theirs.
        g_rows = exchange(g.at[idx].get(mode="fill", fill_value=0), ep_axes, COMBINE,
                          False).reshape(-1, 1, d)
        d_rows, *d_w = vjp(g_rows)
        back = exchange(d_rows.reshape(n_ep, capacity, d), ep_axes, DISPATCH, False)
        dw = tuple(a + b.astype(a.dtype) for a, b in zip(dw, d_w))
        return dx.at[idx // k].add(back.astype(dx.dtype), mode="drop"), dw

    def later_round(carry):
        r, dx, dw = carry
        idx = _sent(r, order, counts, starts, capacity)
        _, vjp = _round_vjp(x, (gate, up, down), flat, idx, k, ep_axes, fp8)
        return r + 1, *backward(r, vjp, dx, dw)

    dx, dw = backward(jnp.zeros((), jnp.int32), first_vjp,
                      zeros(x.shape, accumulator(x), like=x),
                      tuple(zeros(w.shape, accumulator(x), like=w) for w in (gate, up, down)))
    _, dx, dw = jax.lax.while_loop(lambda c: c[0] < rounds, later_round,
                                   (jnp.ones((), jnp.int32), dx, dw))
    return (dx.astype(x.dtype), *(a.astype(w.dtype) for a, w in zip(dw, (gate, up, down))),
            None)


_rounds.defvjp(_rounds_fwd, _rounds_bwd)
