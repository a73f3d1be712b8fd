"""Flash attention in pure JAX: blockwise online softmax with O(S) memory, on every backend.

The forward takes [Q_TILE, KEY_TILE] score blocks (`blockwise.attend_tiled`), never
materialising [S, S], and under the causal mask never computes a block above the
diagonal. It saves only q, k, v, the output and the per-row log-sum-exp; the custom VJP
recomputes each block's probabilities from those (`blockwise.grads_tiled`). Context-parallel
kernels run the same block kernel on their local blocks (`query_offset` places the local
queries in the sequence). A sliding `window` skips the key tiles outside it; learned
`sinks` start each row's softmax (`blockwise.empty`) and get their gradient from its
log-sum-exp (`blockwise.sink_grads`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jdist.parallel.attention import blockwise as bw
from jdist.spmd.varying import varying, vma


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, sinks, offset, segments, causal: bool, q_tile: int, k_tile: int, window):
    return _forward(q, k, v, sinks, offset, segments, causal, q_tile, k_tile, window)[0]


def _forward(q, k, v, sinks, offset, segments, causal, q_tile, k_tile, window):
    qg = bw.group_heads(q, k.shape[2])
    acc = bw.attend_tiled(bw.empty(qg, sinks), qg, k, v, offset if causal else None, q_tile,
                          k_tile, segments, *window)
    out, lse = bw.finish(acc)
    return bw.ungroup_heads(out).astype(q.dtype), lse


def _fwd(q, k, v, sinks, offset, segments, causal, q_tile, k_tile, window):
    out, lse = _forward(q, k, v, sinks, offset, segments, causal, q_tile, k_tile, window)
    return out, (q, k, v, sinks, offset, segments, out, lse)


def _bwd(causal, q_tile, k_tile, window, residuals, dout):
    q, k, v, sinks, offset, segments, out, lse = residuals
    n_kv = k.shape[2]
    dout_g = bw.group_heads(dout, n_kv)
    delta = bw.row_delta(bw.group_heads(out, n_kv), dout_g)
    dq, dk, dv = bw.grads_tiled(bw.group_heads(q, n_kv), k, v, dout_g, lse, delta,
                                offset if causal else None, q_tile, k_tile, segments, *window)
    dsinks = None if sinks is None else bw.sink_grads(sinks, lse, delta).astype(sinks.dtype)
    return (bw.ungroup_heads(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            dsinks, None, None)


_flash.defvjp(_fwd, _bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True, *,
                    query_offset=0, q_tile: int | None = None, k_tile: int | None = None,
                    segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, window: int | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention q [b, s, h, d], k/v [b, t, kv, d] -> [b, s, h, d], exact.
    Causal: query i (at position `query_offset + i`, possibly traced, >= 0) sees keys
    0..that, so every query sees at least key 0; with `window`, only the last `window` of
    them. Packed documents: `segment_ids` [b, s] of the queries and `kv_segment_ids` [b, t]
    of the keys (default: the same); a query sees only keys of its own document. `sinks`
    [h]: a learned logit per head in every row's softmax denominator. Tiles: `q_tile` and
    `k_tile`, by default `blockwise.window_tile(window)`."""
    check_window(window, causal)
    q_tile, k_tile = q_tile or bw.window_tile(window), k_tile or bw.window_tile(window)
    # Queries from position 0 start tiles where keys do: a window's tiles need no margin.
    aligned = isinstance(query_offset, int) and query_offset == 0
    offset = jnp.asarray(query_offset, jnp.int32)
    segments = None
    if segment_ids is not None:
        segments = (segment_ids, segment_ids if kv_segment_ids is None else kv_segment_ids)
    if sinks is not None:  # typed like q, so its gradient is summed by autodiff, not here
        sinks = varying(sinks, vma(q))
    return _flash(q, k, v, sinks, offset, segments, causal, q_tile, k_tile, (window, aligned))


def check_window(window: int | None, causal: bool) -> None:
    """A window counts keys back from each query, so it needs the causal mask and a size."""
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal attention and window >= 1, got "
                         f"window={window}, causal={causal}")
