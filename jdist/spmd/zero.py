"""ZeRO stages over the `data` axis.

`fsdp` always shards parameters, gradients and optimizer state over itself (by the rules).
`--zero N` additionally shards over `data`: 1 = optimizer state, 2 = + gradients (each
layer's gradient reduce-scattered inside the backward, into a sharded accumulator), 3 = +
parameters (so `dp=8 --zero 3` lays out state exactly like `fsdp=8` and runs the same
collectives). Each array gains `data` on one dimension, chosen by `zero_spec`; everything
else about its sharding is unchanged. The collectives themselves are in
`jdist.parallel.grad_sync`.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jdist.spmd import axes as ax
from jdist.spmd.rules import as_candidate, mesh_axes_of

STAGES = (0, 1, 2, 3)
OPTIMIZER, GRADIENTS, PARAMETERS = 1, 2, 3  # the first stage that shards each component



def zero_dim(shape: tuple[int, ...], spec: PartitionSpec, names: tuple, mesh) -> int | None:
    """The dimension that also splits over `data`: the model dimension (embed/norm) when it
    divides evenly, else the largest dimension that does; None if no dimension can."""
    n = mesh.shape[ax.DATA]
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    if n == 1 or ax.DATA in {a for entry in spec for a in mesh_axes_of(entry)}:
        return None

    def splits(i: int) -> bool:
        ways = 1
        for a in mesh_axes_of(spec[i]):
            ways *= mesh.shape[a]
        return shape[i] % (ways * n) == 0

    def replica_only(i: int) -> bool:
        # The gradient shard_map is manual over the replica axes only, and a manual axis
        # must be the major part of a dimension's sharding (jdist.parallel.grad_sync).
        return all(a in ax.REPLICA_AXES for a in mesh_axes_of(spec[i]))

    # Never the stacked `layers` dimension: the layer loop slices one layer off each block
    # leaf and reduce-scatters that layer's gradient, so `data` must split a dimension
    # inside a layer. (A LoRA A of 4 layers and rank 4 tied on size, and the layer axis
    # won: the gradient came back with twice the layers.)
    named = dict(enumerate(names))
    candidates = [i for i in range(len(shape)) if named.get(i) != ax.LAYERS]
    preferred = [i for i in candidates if named.get(i) in (ax.EMBED, ax.NORM)]
    by_size = sorted(candidates, key=lambda i: -shape[i])
    return next((i for i in preferred + by_size if replica_only(i) and splits(i)), None)


def zero_spec(shape: tuple[int, ...], spec: PartitionSpec, names: tuple, mesh) -> PartitionSpec:
    """`spec` with `data` appended (innermost) on the `zero_dim`: the layout a tiled
    reduce-scatter over `data` produces from a block sharded as `spec`."""
    dim = zero_dim(shape, spec, names, mesh)
    if dim is None:
        return spec
    entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
    parts = mesh_axes_of(entries[dim]) + (ax.DATA,)
    entries[dim] = as_candidate(parts)
    return PartitionSpec(*entries)


def zero_shardings(abstract: dict, base: dict, names: dict, mesh) -> dict:
    """Sharded-over-data counterparts of the parameter shardings `base`."""
    return jax.tree.map(
        lambda leaf, s, n: NamedSharding(mesh, zero_spec(leaf.shape, s.spec, n, mesh)),
        abstract, base, names, is_leaf=lambda x: isinstance(x, tuple))
