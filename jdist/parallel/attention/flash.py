"""Flash attention in pure JAX: blockwise online softmax with O(S) memory, on every backend.

The forward takes [Q_TILE, KEY_TILE] score blocks (`blockwise.attend_tiled`), never
materialising [S, S], and under the causal mask never computes a block above the
diagonal. It saves only q, k, v, the output and the per-row log-sum-exp; the custom VJP
recomputes each block's probabilities from those (`blockwise.grads_tiled`). Context-parallel
kernels run the same block kernel on their local blocks (`query_offset` places the local
queries in the sequence).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jdist.parallel.attention import blockwise as bw


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, offset, segments, causal: bool, q_tile: int, k_tile: int):
    return _forward(q, k, v, offset, segments, causal, q_tile, k_tile)[0]


def _forward(q, k, v, offset, segments, causal, q_tile, k_tile):
    qg = bw.group_heads(q, k.shape[2])
    acc = bw.attend_tiled(bw.empty(qg), qg, k, v, offset if causal else None, q_tile, k_tile,
                          segments)
    out, lse = bw.finish(acc)
    return bw.ungroup_heads(out).astype(q.dtype), lse


def _fwd(q, k, v, offset, segments, causal, q_tile, k_tile):
    out, lse = _forward(q, k, v, offset, segments, causal, q_tile, k_tile)
    return out, (q, k, v, offset, segments, out, lse)


def _bwd(causal, q_tile, k_tile, residuals, dout):
    q, k, v, offset, segments, out, lse = residuals
    n_kv = k.shape[2]
    dout_g = bw.group_heads(dout, n_kv)
    delta = bw.row_delta(bw.group_heads(out, n_kv), dout_g)
    dq, dk, dv = bw.grads_tiled(bw.group_heads(q, n_kv), k, v, dout_g, lse, delta,
                                offset if causal else None, q_tile, k_tile, segments)
    return (bw.ungroup_heads(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None)


_flash.defvjp(_fwd, _bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True, *,
                    query_offset=0, q_tile: int = bw.Q_TILE, k_tile: int = bw.KEY_TILE,
                    segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention q [b, s, h, d], k/v [b, t, kv, d] -> [b, s, h, d], exact.
    Causal: query i (at position `query_offset + i`, possibly traced, >= 0) sees keys
    0..that, so every query sees at least key 0. Packed documents: `segment_ids` [b, s] of
    the queries and `kv_segment_ids` [b, t] of the keys (default: the same); a query sees
    only keys of its own document."""
    offset = jnp.asarray(query_offset, jnp.int32)
    segments = None
    if segment_ids is not None:
        segments = (segment_ids, segment_ids if kv_segment_ids is None else kv_segment_ids)
    return _flash(q, k, v, offset, segments, causal, q_tile, k_tile)
