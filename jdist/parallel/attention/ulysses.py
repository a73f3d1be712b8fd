"""Ulysses attention: all-to-all from sequence sharding to head sharding, full-sequence
attention on H/N heads per device (the flash block kernel), then all-to-all back.

Each device trades its sequence slice of every head for the full sequence of 1/N of the
heads, attends locally, and trades back. Communication per layer is four all-to-alls of
activation size / N (q, k, v in; output back), independent of the ring's N steps, but the
local head count must divide by N. With grouped-query attention the kv heads are repeated
just enough to divide by N, so each device gets the kv heads its query heads use.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jdist.parallel import CHECK_VMA, kernel_mesh
from jdist.parallel.attention.flash import flash_attention


def kv_repeats(local_kv_heads: int, n: int) -> int:
    """How often to repeat each kv head so the kv heads split n ways."""
    return n // math.gcd(local_kv_heads, n)


def _local(axis: tuple[str, ...], n: int, causal: bool, window, q, k, v, seg, sinks):
    # This device attends with local heads [i*h/n, (i+1)*h/n), the all-to-all's i-th part.
    heads = q.shape[2] // n
    sinks = lax.dynamic_slice_in_dim(sinks[0], lax.axis_index(axis) * heads, heads) \
        if sinks else None
    rep = kv_repeats(k.shape[2], n)
    if rep > 1:  # repeating kv head i as i*rep .. i*rep+rep-1 keeps head h -> kv h // group
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    to_heads = partial(lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    # Now the whole sequence, in order; packed documents need the whole sequence's ids.
    segments = {"segment_ids": lax.all_gather(seg[0], axis, axis=1, tiled=True)} if seg else {}
    out = flash_attention(q, k, v, causal, window=window, sinks=sinks, **segments)
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh, q_spec: PartitionSpec,
                      kv_spec: PartitionSpec, axis: tuple[str, ...], n: int,
                      causal: bool, segment_ids: jax.Array | None = None,
                      window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Attention of global q [b, S, h, d] against k, v [b, S, kv, d] (contiguous layout);
    the local head count must be divisible by `n`. `segment_ids` [b, S]: packed documents;
    a sliding `window` and `sinks` [h] as `flash_attention` takes them."""
    seg = () if segment_ids is None else (segment_ids,)
    sink = () if sinks is None else (sinks,)
    specs = ((PartitionSpec(*q_spec[:2]),) * len(seg), (PartitionSpec(q_spec[2]),) * len(sink))
    return jax.shard_map(partial(_local, axis, n, causal, window), **kernel_mesh(mesh),
                         in_specs=(q_spec, kv_spec, kv_spec, *specs), out_specs=q_spec,
                         check_vma=CHECK_VMA)(q, k, v, seg, sink)
