"""All-gather attention: every device gathers the whole sequence's keys and values once per
layer and attends its local queries to them.

The simplest context-parallel strategy: one all-gather of K/V forward (a reduce-scatter of
their gradients backward, by autodiff). Per-device memory holds all S keys and an
[S/N, S] score block, so it grows with S where ring attention's does not.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jdist.parallel import CHECK_VMA, kernel_mesh
from jdist.parallel import blockwise as bw


def _local(axis: tuple[str, ...], n: int, causal: bool, q, k, v):
    k, v = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
    size = q.shape[1]  # the layout is contiguous: device j holds positions [j*size, (j+1)*size)
    q_pos = lax.axis_index(axis) * size + jnp.arange(size)
    mask = bw.causal_mask(q_pos, jnp.arange(n * size)) if causal else None
    out = bw.dense(bw.group_heads(q, k.shape[2]), k, v, mask)
    return bw.ungroup_heads(out).astype(q.dtype)


def all_gather_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh,
                         q_spec: PartitionSpec, kv_spec: PartitionSpec, axis: tuple[str, ...],
                         n: int, causal: bool) -> jax.Array:
    """Attention of global q [b, S, h, d] against k, v [b, S, kv, d] (contiguous layout)."""
    return jax.shard_map(partial(_local, axis, n, causal), **kernel_mesh(mesh),
                         in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=CHECK_VMA)(q, k, v)
