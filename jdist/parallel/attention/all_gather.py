"""All-gather attention: every device gathers the whole sequence's keys and values once per
layer and attends its local queries to them with the flash block kernel.

The simplest context-parallel strategy: one all-gather of K/V forward (a reduce-scatter of
their gradients backward, by autodiff). Per-device memory holds all S keys, so it grows
with S where ring attention's does not; scores stay [Q_TILE, KEY_TILE] blocks.
"""

from __future__ import annotations

from functools import partial

import jax
from jax import lax
from jax.sharding import PartitionSpec

from jdist.parallel import CHECK_VMA, kernel_mesh
from jdist.parallel.attention.flash import flash_attention


def _local(axis: tuple[str, ...], n: int, causal: bool, window, q, k, v, seg, sinks):
    gather = lambda x: lax.all_gather(x, axis, axis=1, tiled=True)
    k, v = gather(k), gather(v)
    segments = {} if not seg else {"segment_ids": seg[0], "kv_segment_ids": gather(seg[0])}
    # The layout is contiguous: device j holds positions [j*size, (j+1)*size); a window
    # skips the key tiles before this device's queries' windows.
    return flash_attention(q, k, v, causal, query_offset=lax.axis_index(axis) * q.shape[1],
                           window=window, sinks=sinks[0] if sinks else None, **segments)


def all_gather_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh,
                         q_spec: PartitionSpec, kv_spec: PartitionSpec, axis: tuple[str, ...],
                         n: int, causal: bool, segment_ids: jax.Array | None = None,
                         window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Attention of global q [b, S, h, d] against k, v [b, S, kv, d] (contiguous layout);
    `segment_ids` [b, S] keeps packed documents apart; a sliding `window` and `sinks` [h]
    as `flash_attention` takes them."""
    seg = () if segment_ids is None else (segment_ids,)
    sink = () if sinks is None else (sinks,)
    specs = ((PartitionSpec(*q_spec[:2]),) * len(seg), (PartitionSpec(q_spec[2]),) * len(sink))
    return jax.shard_map(partial(_local, axis, n, causal, window), **kernel_mesh(mesh),
                         in_specs=(q_spec, kv_spec, kv_spec, *specs), out_specs=q_spec,
                         check_vma=CHECK_VMA)(q, k, v, seg, sink)
