"""Attention on blocks of queries and keys: the arithmetic every context-parallel strategy
shares.

An online-softmax accumulator merges key blocks one at a time, in any order, so no device
ever needs all keys at once; `block_grads` recomputes one block's gradients from the final
log-sum-exp, so the backward pass needs no per-block residuals either (FlashAttention-2).

Layout: queries grouped under their kv head, q [b, s, kv, g, d]; keys/values k, v
[b, t, kv, d]. Statistics are [b, kv, g, s]. Everything accumulates in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdist.parallel import varying, vma, zeros

# A masked score. Finite, so exp(MASKED - max) is exactly 0 and an all-masked row is never NaN.
MASKED = float(jnp.finfo(jnp.float32).min)
# Keys per score block in the tiled functions: bounds a live score block to [queries, 512]
# (memory linear in the local sequence) while keeping each matmul large.
KEY_TILE = 512


class Acc(NamedTuple):
    """Running softmax state of a query block: sum_j exp(s_j - m) v_j, max m, sum_j exp(s_j - m)."""

    out: jax.Array  # [b, s, kv, g, d] float32, not yet divided by `norm`
    max: jax.Array  # [b, kv, g, s]
    norm: jax.Array  # [b, kv, g, s]


def group_heads(x: jax.Array, n_kv: int) -> jax.Array:
    """[b, s, h, d] -> [b, s, kv, h/kv, d]: head h uses kv head h // (h/kv), as in GQA."""
    b, s, h, d = x.shape
    return x.reshape(b, s, n_kv, h // n_kv, d)


def ungroup_heads(x: jax.Array) -> jax.Array:
    b, s, kv, g, d = x.shape
    return x.reshape(b, s, kv * g, d)


def causal_mask(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """[s, t] booleans: query at position q_pos[i] may see key at k_pos[j]."""
    return q_pos[:, None] >= k_pos[None, :]


def scores(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Scaled, masked logits [b, kv, g, s, t] in float32."""
    s = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
    s = s * (q.shape[-1] ** -0.5)
    return s if mask is None else jnp.where(mask, s, MASKED)


def empty(q: jax.Array) -> Acc:
    """The accumulator before any key block was seen."""
    b, s, kv, g, d = q.shape
    stats = (b, kv, g, s)
    return Acc(zeros((b, s, kv, g, d), jnp.float32, q),
               varying(jnp.full(stats, MASKED, jnp.float32), vma(q)),
               zeros(stats, jnp.float32, q))


def attend(acc: Acc, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> Acc:
    """Merge one key/value block into the accumulator (log-sum-exp rescaling)."""
    s = scores(q, k, mask)
    # The max only keeps exp() in range; the result does not depend on it, so no gradient.
    new_max = jax.lax.stop_gradient(jnp.maximum(acc.max, s.max(axis=-1)))
    p = jnp.exp(s - new_max[..., None])
    rescale = jnp.exp(acc.max - new_max)
    pv = jnp.einsum("bkgst,btkd->bskgd", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)
    out = acc.out * _to_rows(rescale) + pv
    return Acc(out, new_max, acc.norm * rescale + p.sum(axis=-1))


def attend_tiled(acc: Acc, q: jax.Array, k: jax.Array, v: jax.Array, diagonal: bool,
                 tile: int = KEY_TILE) -> Acc:
    """`attend` over key tiles of at most `tile` positions, so only an [s, tile] score block
    is ever live. `diagonal`: q and k cover the same positions; mask causally."""
    s, t = q.shape[1], k.shape[1]
    tile = _divisor_at_most(t, tile)

    def body(acc, xs):
        k_tile, v_tile, start = xs
        mask = causal_mask(jnp.arange(s), start + jnp.arange(tile)) if diagonal else None
        return attend(acc, q, k_tile, v_tile, mask), None

    if tile == t:
        return body(acc, (k, v, 0))[0]
    acc, _ = jax.lax.scan(body, acc, (_tiles(k, tile), _tiles(v, tile), jnp.arange(0, t, tile)))
    return acc


def finish(acc: Acc) -> tuple[jax.Array, jax.Array]:
    """(normalised output [b, s, kv, g, d] float32, log-sum-exp [b, kv, g, s])."""
    return acc.out / _to_rows(acc.norm), acc.max + jnp.log(acc.norm)


def dense(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Exact attention of q against all of k/v in one block (differentiable by autodiff)."""
    out, _ = finish(attend(empty(q), q, k, v, mask))
    return out


def block_grads(q, k, v, dout, lse, delta, mask) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients (float32) w.r.t. q, k, v of one block, given the whole row's log-sum-exp
    `lse` and delta = sum(dout * out) per row [b, kv, g, s]."""
    p = jnp.exp(scores(q, k, mask) - lse[..., None])  # final probabilities of this block
    dout32 = dout.astype(jnp.float32)
    dv = jnp.einsum("bkgst,bskgd->btkd", p, dout32)
    dp = jnp.einsum("bskgd,btkd->bkgst", dout32, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * (q.shape[-1] ** -0.5)
    dq = jnp.einsum("bkgst,btkd->bskgd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgst,bskgd->btkd", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def grads_tiled(q, k, v, dout, lse, delta, diagonal: bool,
                tile: int = KEY_TILE) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`block_grads` over key tiles of at most `tile` positions (see `attend_tiled`)."""
    s, t = q.shape[1], k.shape[1]
    tile = _divisor_at_most(t, tile)

    def body(dq, xs):
        k_tile, v_tile, start = xs
        mask = causal_mask(jnp.arange(s), start + jnp.arange(tile)) if diagonal else None
        dq_tile, dk, dv = block_grads(q, k_tile, v_tile, dout, lse, delta, mask)
        return dq + dq_tile, (dk, dv)

    if tile == t:
        dq, (dk, dv) = body(0.0, (k, v, 0))
        return dq, dk, dv
    dq, (dk, dv) = jax.lax.scan(body, zeros(q.shape, jnp.float32, q),
                                (_tiles(k, tile), _tiles(v, tile), jnp.arange(0, t, tile)))
    return dq, _untile(dk), _untile(dv)


def row_delta(out: jax.Array, dout: jax.Array) -> jax.Array:
    """sum_d dout * out per query row, [b, kv, g, s]: the softmax-backward correction."""
    d = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
    return jnp.transpose(d, (0, 2, 3, 1))


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _tiles(x: jax.Array, tile: int) -> jax.Array:
    """[b, t, ...] -> [t/tile, b, tile, ...], tiles leading for `lax.scan`."""
    b, t = x.shape[:2]
    return jnp.swapaxes(x.reshape(b, t // tile, tile, *x.shape[2:]), 0, 1)


def _untile(x: jax.Array) -> jax.Array:
    n, b, tile = x.shape[:3]
    return jnp.swapaxes(x, 0, 1).reshape(b, n * tile, *x.shape[3:])


def _to_rows(stat: jax.Array) -> jax.Array:
    """[b, kv, g, s] -> [b, s, kv, g, 1], to scale output rows."""
    return jnp.transpose(stat, (0, 3, 1, 2))[..., None]
