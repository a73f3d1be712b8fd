"""Grouped dropless experts under expert parallelism: tokens travel in bounded rounds.

Static shapes cannot size a receive buffer to what routing sends (up to every token of every
device to one device). So each device sends each expert-parallel peer at most `capacity`
assignments per round, ROUND_FACTOR x the even share, and rounds repeat until every
assignment has been served: one round when routing is near balance, more (never a drop)
when it is not. Per round, the tokens and their local expert ids go out by all-to-all, the
receiver runs its experts on the rows it got (`models.grouped`: the rows it received,
padded to one-expert blocks), and the outputs come back by a second all-to-all.

The round count depends on the routing, so the rounds are a `while_loop`, which autodiff
cannot reverse; a custom VJP runs the rounds again in the backward, recomputing each round's
expert forward for its VJP (the price: one more expert forward, as `--remat full` pays).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jdist.models.grouped import grouped_swiglu
from jdist.varying import varying, vma, zeros

ROUND_FACTOR = 1.2  # per-peer room per round over the even share (bytes and FLOPs per round)


def round_capacity(assignments: int, n_ep: int) -> int:
    """Assignments a device sends each peer per round."""
    return max(1, math.ceil(ROUND_FACTOR * assignments / n_ep))


def routed_rounds(x, w, experts, ep_axes: tuple, n_ep: int) -> jax.Array:
    """Every assignment's expert output [T k, d] (partial over `tensor` where the experts'
    hidden units are split). Inside a shard_map over `ep_axes`; w holds the local experts."""
    axes = tuple(sorted(set(vma(x)) | set(vma(w["w_gate"]))))
    # Both vary over every axis either does before the custom VJP sees them, so autodiff
    # sums the gradients the VJP returns over the axes that share them.
    x = varying(x, axes)
    w = tuple(varying(w[k].astype(x.dtype), axes) for k in ("w_gate", "w_up", "w_down"))
    return _rounds(x, *w, experts, tuple(ep_axes), n_ep)


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


def _exchange(a, ep_axes):
    return jax.lax.all_to_all(a, ep_axes, 0, 0, tiled=True)


def _round_inputs(x, flat, idx, k: int, e_local: int, ep_axes):
    """The rows and local expert ids one round delivers to this device, flattened."""
    d = x.shape[-1]
    rows = x.at[idx // k].get(mode="fill", fill_value=0)
    ids = flat.at[idx].get(mode="fill", fill_value=0) % e_local
    return _exchange(rows, ep_axes).reshape(-1, d), _exchange(ids, ep_axes).reshape(-1, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _rounds(x, gate, up, down, experts, ep_axes, n_ep):
    return _rounds_fwd(x, gate, up, down, experts, ep_axes, n_ep)[0]


def _rounds_fwd(x, gate, up, down, experts, ep_axes, n_ep):
    t, k = experts.shape
    e_local, d = gate.shape[0], x.shape[-1]
    capacity = round_capacity(t * k, n_ep)
    flat, order, counts, starts, rounds = _plan(experts, e_local, n_ep, capacity, ep_axes)

    def one_round(carry):
        r, out = carry
        idx = _sent(r, order, counts, starts, capacity)
        rows, ids = _round_inputs(x, flat, idx, k, e_local, ep_axes)
        served = grouped_swiglu(rows, ids, gate, up, down).reshape(n_ep, capacity, d)
        return r + 1, out.at[idx].add(_exchange(served, ep_axes), mode="drop")

    start = (jnp.zeros((), jnp.int32), zeros((t * k, d), x.dtype, like=x))
    _, out = jax.lax.while_loop(lambda c: c[0] < rounds, one_round, start)
    return out, (x, gate, up, down, experts)


def _rounds_bwd(ep_axes, n_ep, res, g):
    x, gate, up, down, experts = res
    t, k = experts.shape
    e_local, d = gate.shape[0], x.shape[-1]
    capacity = round_capacity(t * k, n_ep)
    flat, order, counts, starts, rounds = _plan(experts, e_local, n_ep, capacity, ep_axes)

    def one_round(carry):
        r, dx, dw = carry
        idx = _sent(r, order, counts, starts, capacity)
        rows, ids = _round_inputs(x, flat, idx, k, e_local, ep_axes)
        g_rows = _exchange(g.at[idx].get(mode="fill", fill_value=0), ep_axes).reshape(-1, 1, d)
        _, vjp = jax.vjp(lambda r_, *w: grouped_swiglu(r_, ids, *w), rows, gate, up, down)
        d_rows, *d_w = vjp(g_rows)
        back = _exchange(d_rows.reshape(n_ep, capacity, d), ep_axes)
        dw = tuple(a + b.astype(jnp.float32) for a, b in zip(dw, d_w))
        return r + 1, dx.at[idx // k].add(back.astype(jnp.float32), mode="drop"), dw

    start = (jnp.zeros((), jnp.int32), zeros(x.shape, jnp.float32, like=x),
             tuple(zeros(w.shape, jnp.float32, like=w) for w in (gate, up, down)))
    _, dx, dw = jax.lax.while_loop(lambda c: c[0] < rounds, one_round, start)
    return (dx.astype(x.dtype), *(a.astype(w.dtype) for a, w in zip(dw, (gate, up, down))),
            None)


_rounds.defvjp(_rounds_fwd, _rounds_bwd)
