"""Attention on blocks of queries and keys: the arithmetic every context-parallel strategy
shares.

An online-softmax accumulator merges key blocks one at a time, in any order, so no device
ever needs all keys at once; `block_grads` recomputes one block's gradients from the final
log-sum-exp, so the backward pass needs no per-block residuals either (FlashAttention-2).

Sliding windows: a query at position p sees keys p - window + 1 .. p (HF's
`sliding_window`), and key tiles wholly outside every window of a query tile are never
computed, so the work is proportional to the window. Learned sinks (gpt-oss): one logit per
head in every softmax denominator and no value, i.e. the accumulator starts with it
(`empty`), and its gradient comes from the final log-sum-exp (`sink_grads`).

Layout: queries grouped under their kv head, q [b, s, kv, g, d]; keys/values k, v
[b, t, kv, d]. Statistics are [b, kv, g, s]. Everything accumulates in float32
(`models.precision.accumulator`: wider in float64 runs).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jdist.models.layers import in_window
from jdist.models.precision import accumulator
from jdist.spmd.varying import varying, vma, zeros

# A masked score. Finite, so exp(MASKED - max) is exactly 0 and an all-masked row is never NaN.
MASKED = float(jnp.finfo(jnp.float32).min)
# Keys and queries per score block in the tiled functions: a live block is [512, 512] per
# head (memory linear in the sequence) while each matmul stays large.
KEY_TILE = 512
Q_TILE = 512
# The smallest tile a sliding window gets (`window_tile`): a matmul's worth of work.
MIN_WINDOW_TILE = 128


def window_tile(window: int | None) -> int:
    """Queries and keys per tile under a sliding window: the window rounded up to a power
    of two, from MIN_WINDOW_TILE to Q_TILE. A window of 128 in 512-key tiles would compute
    mostly masked scores (gpt-oss's window is 128)."""
    if window is None:
        return Q_TILE
    return min(Q_TILE, max(MIN_WINDOW_TILE, 1 << (window - 1).bit_length()))


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


def block_mask(offset, q_start, tq: int, k_start, tk: int, segments=None, window=None):
    """The mask of the score block of queries q_start.. and keys k_start..: causal (query
    i at position offset + i; None: no causal mask), within `window` positions if given
    (causal only) and, with `segments` = (query segment ids [b, s], key segment ids [b, t])
    of packed documents, only within a document ([b, 1, 1, tq, tk]). None when nothing is
    masked."""
    mask = None
    if offset is not None:
        q_pos, k_pos = offset + q_start + jnp.arange(tq), k_start + jnp.arange(tk)
        mask = causal_mask(q_pos, k_pos)
        if window is not None:
            mask = mask & in_window(q_pos, k_pos, window)
    if segments is None:
        return mask
    q_seg = lax.dynamic_slice_in_dim(segments[0], q_start, tq, 1)
    k_seg = lax.dynamic_slice_in_dim(segments[1], k_start, tk, 1)
    same = (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
    return same if mask is None else same & mask


def scores(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Scaled, masked logits [b, kv, g, s, t] in float32 (`accumulator`)."""
    s = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=accumulator(q, k))
    s = s * (q.shape[-1] ** -0.5)
    return s if mask is None else jnp.where(mask, s, MASKED)


def empty(q: jax.Array, sinks: jax.Array | None = None) -> Acc:
    """The accumulator before any key block was seen; with `sinks` [h] (one logit per head,
    no value), it has seen them: max = sink, norm = exp(sink - max) = 1."""
    b, s, kv, g, d = q.shape
    stats = (b, kv, g, s)
    acc = accumulator(q)
    out = zeros((b, s, kv, g, d), acc, q)
    if sinks is None:
        return Acc(out, varying(jnp.full(stats, MASKED, acc), vma(q)), zeros(stats, acc, q))
    start = jnp.broadcast_to(sinks.astype(acc).reshape(kv, g, 1), stats)
    return Acc(out, varying(start, vma(q)), varying(jnp.ones(stats, acc), vma(q)))


def sink_grads(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """d loss / d sinks [h] from the rows' final log-sum-exp and delta [b, kv, g, s]: the
    sink's probability p = exp(sink - lse) times (0 - delta), its value being zero."""
    p = jnp.exp(sinks.astype(lse.dtype).reshape(lse.shape[1:3])[None, :, :, None] - lse)
    return -jnp.sum(p * delta, axis=(0, 3)).reshape(-1)


def attend(acc: Acc, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> Acc:
    """Merge one key/value block into the accumulator (log-sum-exp rescaling)."""
    s = scores(q, k, mask)
    # The max only keeps exp() in range; the result does not depend on it, so no gradient.
    new_max = jax.lax.stop_gradient(jnp.maximum(acc.max, s.max(axis=-1)))
    p = jnp.exp(s - new_max[..., None])
    rescale = jnp.exp(acc.max - new_max)
    pv = jnp.einsum("bkgst,btkd->bskgd", p.astype(v.dtype), v,
                    preferred_element_type=acc.out.dtype)
    out = acc.out * _to_rows(rescale) + pv
    return Acc(out, new_max, acc.norm * rescale + p.sum(axis=-1))


def attend_tiled(acc: Acc, q: jax.Array, k: jax.Array, v: jax.Array, offset=None,
                 q_tile: int = Q_TILE, k_tile: int = KEY_TILE, segments=None,
                 window: int | None = None, aligned: bool = False) -> Acc:
    """`attend` over [q_tile, k_tile] score blocks, so only one such block is ever live.

    `offset` None: no causal mask. Else causal: query i sits at position `offset + i` (a
    traced integer is fine), key j at position j; key tiles entirely after a query tile's
    last position are never computed (the loop over them stops early). `segments`: packed
    documents' (query, key) segment ids, see `block_mask`. `window` (causal only): key
    tiles wholly before every window of the query tile are skipped too, `aligned` saying
    that `offset` is a multiple of the tiles (one tile fewer per window). A row whose keys in
    a block are all masked takes exp(0) weights there, but every row sees its own token
    somewhere, and that block's larger max rescales them by exp(MASKED - max) = 0."""
    s, t = q.shape[1], k.shape[1]
    tq, tk = _divisor_at_most(s, q_tile), _divisor_at_most(t, k_tile)

    def q_block(i, acc_i, q_i):
        def k_block(j, acc_i):
            k_j, v_j = (lax.dynamic_slice_in_dim(x, j * tk, tk, 1) for x in (k, v))
            mask = block_mask(offset, i * tq, tq, j * tk, tk, segments, window)
            return attend(acc_i, q_i, k_j, v_j, mask)
        return _tile_loop(_key_tiles(offset, i, tq, tk, t, window, aligned), k_block,
                          _varying_acc(acc_i, q_i, k))

    if tq == s:
        return q_block(0, acc, q)

    def body(_, xs):
        i, out, m, norm, q_i = xs
        return None, q_block(i, Acc(out, m, norm), q_i)

    tiles = (jnp.arange(s // tq), _tiles(acc.out, tq), _stat_tiles(acc.max, tq),
             _stat_tiles(acc.norm, tq), _tiles(q, tq))
    _, new = lax.scan(body, None, tiles)
    return Acc(_untile(new.out), _stat_untile(new.max), _stat_untile(new.norm))


def finish(acc: Acc) -> tuple[jax.Array, jax.Array]:
    """(normalised output [b, s, kv, g, d] float32, log-sum-exp [b, kv, g, s])."""
    return acc.out / _to_rows(acc.norm), acc.max + jnp.log(acc.norm)


def block_grads(q, k, v, dout, lse, delta, mask) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients (float32) w.r.t. q, k, v of one block, given the whole row's log-sum-exp
    `lse` and delta = sum(dout * out) per row [b, kv, g, s]."""
    p = jnp.exp(scores(q, k, mask) - lse[..., None])  # final probabilities of this block
    # Matmul operands in the inputs' dtype (bf16 runs on tensor cores, as in the forward),
    # every product accumulated in float32 (or wider).
    acc = accumulator(q, k, v, dout)
    dv = jnp.einsum("bkgst,bskgd->btkd", p.astype(dout.dtype), dout, preferred_element_type=acc)
    dp = jnp.einsum("bskgd,btkd->bkgst", dout, v.astype(dout.dtype), preferred_element_type=acc)
    ds = (p * (dp - delta[..., None]) * (q.shape[-1] ** -0.5)).astype(q.dtype)
    dq = jnp.einsum("bkgst,btkd->bskgd", ds, k, preferred_element_type=acc)
    dk = jnp.einsum("bkgst,bskgd->btkd", ds, q, preferred_element_type=acc)
    return dq, dk, dv


def grads_tiled(q, k, v, dout, lse, delta, offset=None, q_tile: int = Q_TILE,
                k_tile: int = KEY_TILE, segments=None, window: int | None = None,
                aligned: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`block_grads` over [q_tile, k_tile] blocks (masking and skipping as `attend_tiled`):
    an outer loop over key tiles, whose dk/dv accumulate in the inner loop over the query
    tiles that see them, and dq accumulated in place."""
    s, t = q.shape[1], k.shape[1]
    tq, tk = _divisor_at_most(s, q_tile), _divisor_at_most(t, k_tile)
    rows = lambda x, i: lax.dynamic_slice_in_dim(x, i * tq, tq, 1)
    stat = lambda x, i: lax.dynamic_slice_in_dim(x, i * tq, tq, x.ndim - 1)

    def k_block(dq, xs):
        j, k_j, v_j = xs

        def q_block(i, carry):
            dq, dk, dv = carry
            mask = block_mask(offset, i * tq, tq, j * tk, tk, segments, window)
            dq_i, dk_i, dv_i = block_grads(rows(q, i), k_j, v_j, rows(dout, i), stat(lse, i),
                                           stat(delta, i), mask)
            dq = lax.dynamic_update_slice_in_dim(dq, rows(dq, i) + dq_i, i * tq, 1)
            return dq, dk + dk_i, dv + dv_i

        dkv = _zeros_like_all(k_j.shape, q, k, dout)
        dq, dk, dv = _tile_loop(_query_tiles(offset, j, tq, tk, s, window, aligned), q_block,
                                (dq, dkv, dkv))
        return dq, (dk, dv)

    dq0 = _zeros_like_all(q.shape, q, k, dout)
    dq, (dk, dv) = lax.scan(k_block, dq0, (jnp.arange(t // tk), _tiles(k, tk), _tiles(v, tk)))
    return dq, _untile(dk), _untile(dv)


def _key_tiles(offset, i, tq: int, tk: int, t: int, window, aligned: bool):
    """(first, end, count) of the key tiles query tile i sees: all without a causal mask;
    causal, up to the tile of its last query. With a window, the `count` (static) tiles
    from the one holding its first query's first key: a static trip count, so the
    compiler counts the FLOPs a window costs (`_tiles_spanned`); a window too wide to
    save work that way runs first..end (both ends dynamic) instead."""
    if offset is None:
        return 0, t // tk, None
    end = jnp.clip((offset + (i + 1) * tq - 1) // tk + 1, 0, t // tk)
    if window is None:
        return 0, end, None
    first = (offset + i * tq - window + 1) // tk
    count = _tiles_spanned(tq, tk, window, aligned)
    if 2 * count >= t // tk + 1:  # not under causal's mean: skip both sides, dynamically
        return jnp.clip(first, 0, end), end, None
    return jnp.clip(first, 0, t // tk - count), None, count


def _query_tiles(offset, j, tq: int, tk: int, s: int, window, aligned: bool):
    """(first, end, count) of the query tiles that see key tile j (the transpose of
    `_key_tiles`): from the tile of the first query at or after its first key; with a
    window, `count` (static) tiles reaching the last query whose window holds its last key."""
    if offset is None:
        return 0, s // tq, None
    first = jnp.clip((j * tk - offset) // tq, 0, s // tq)
    if window is None:
        return first, s // tq, None
    count = _tiles_spanned(tk, tq, window, aligned)
    if 2 * count >= s // tq + 1:  # not under causal's mean: skip both sides, dynamically
        last = ((j + 1) * tk - 1 + window - 1 - offset) // tq
        return first, jnp.clip(last + 1, first, s // tq), None
    return jnp.minimum(first, s // tq - count), None, count


def _tiles_spanned(own: int, tile: int, window: int, aligned: bool) -> int:
    """The most tiles of `tile` positions that the windows of a tile of `own` positions
    (own + window - 1 consecutive positions) touch: however they are aligned, or, when
    `aligned` (equal tiles starting at a multiple of the tile), the tile itself and
    ceil((window - 1) / tile) before it."""
    if aligned and own == tile:
        return 1 + -(-(window - 1) // tile)
    return (own + window - 1 + tile - 2) // tile + 1


def _tile_loop(tiles: tuple, body, init):
    """`body(tile, carry)` over tiles (first, end, count): first..end-1, or, with a static
    `count`, first..first+count-1 (tiles the window misses inside them are masked)."""
    first, end, count = tiles
    if count is None:
        return lax.fori_loop(first, end, body, init)
    return lax.fori_loop(0, count, lambda u, carry: body(first + u, carry), init)


def row_delta(out: jax.Array, dout: jax.Array) -> jax.Array:
    """sum_d dout * out per query row, [b, kv, g, s]: the softmax-backward correction."""
    acc = accumulator(out, dout)
    d = jnp.sum(out.astype(acc) * dout.astype(acc), axis=-1)
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


def _stat_tiles(x: jax.Array, tile: int) -> jax.Array:
    """Statistics [b, kv, g, s] -> [s/tile, b, kv, g, tile]."""
    n = x.shape[-1] // tile
    return jnp.moveaxis(x.reshape(*x.shape[:-1], n, tile), -2, 0)


def _stat_untile(x: jax.Array) -> jax.Array:
    x = jnp.moveaxis(x, 0, -2)
    return x.reshape(*x.shape[:-2], -1)


def _zeros_like_all(shape, *like) -> jax.Array:
    """float32 (`accumulator`) zeros varying over every manual axis any of `like` varies
    over (a loop carry that the loop body makes depend on all of them)."""
    return varying(jnp.zeros(shape, accumulator(*like)), tuple({a for x in like for a in vma(x)}))


def _varying_acc(acc: Acc, *like) -> Acc:
    axes = tuple({a for x in (acc.out, *like) for a in vma(x)})
    return Acc(*(varying(x, axes) for x in acc))


def _to_rows(stat: jax.Array) -> jax.Array:
    """[b, kv, g, s] -> [b, s, kv, g, 1], to scale output rows."""
    return jnp.transpose(stat, (0, 3, 1, 2))[..., None]
