"""The embedding and the output head over pipeline stages: stored split over `stage`, like
ZeRO-3 over stages, instead of replicated on every stage.

Only the first chunk embeds and only the last scores, but one SPMD program gives every
device the same shapes, so "the table lives on the first stage" cannot be a sharding: a
stage-0-only table would be a slot of that size on every stage. Splitting each table over
`stage` as well (one more split of its model dimension, after fsdp and ZeRO's) stores 1/P
of it per device instead, its gradients and Adam moments too: at P >= 2 no device holds more than
the first or last stage would in an analytical split (P = 2: as much), and the middle stages
hold what the end stages would lose.

Per step, before the tick loop, each leaf is gathered over `stage` (one all-gather; inside
a tick, a collective over `stage` would run in one stage's branch only: see
`jdist.parallel.pipeline.program`), and after it the accumulated gradients, nonzero only where
a chunk used them, are reduce-scattered over `stage` back to the stored split. That pair
moves what the all-reduce of replicated gradients moved, and a tied table needs nothing
more: both chunks' gradients land in the one accumulator. The final norm's scale (d_model
floats), and a table no dimension of which splits, stay replicated over `stage` and their
gradients are summed over it.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jdist.models.names import is_blocks
from jdist.parallel import grad_sync as gs
from jdist.spmd import axes as ax
from jdist.spmd.rules import as_candidate, mesh_axes_of


def split_dims(abstract: dict, shardings: dict, names: dict, mesh) -> dict:
    """Per leaf, the dimension that also splits over `stage` (None: none does): the tables'
    (leaves with a vocabulary dimension) model dimension when it divides, else their
    largest that does, among those split over replica axes only (`stage` goes innermost, so
    gathering over it rebuilds the block the other axes give each device; a dimension split
    over `tensor` as well would come back in the wrong order). `shardings`: the most split
    layout the leaves get (ZeRO's), so parameters, gradients and moments agree."""
    stages = mesh.shape[ax.STAGE]

    def one(path, leaf, sharding, leaf_names):
        if stages == 1 or is_blocks(path[0]) or ax.VOCAB not in leaf_names:
            return None
        entries = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))

        def fits(i: int) -> bool:
            axes = mesh_axes_of(entries[i])
            return all(a in ax.REPLICA_AXES for a in axes) and leaf.shape[i] % (
                stages * math.prod(mesh.shape[a] for a in axes)) == 0

        order = sorted(range(leaf.ndim), key=lambda i: (leaf_names[i] != ax.EMBED,
                                                        -leaf.shape[i]))
        return next((i for i in order if fits(i)), None)

    return jax.tree_util.tree_map_with_path(one, abstract, shardings, names,
                                            is_leaf=lambda x: isinstance(x, tuple))


def over_stages(shardings: dict, dims: dict) -> dict:
    """`shardings` with `stage` appended on each leaf's `split_dims` dimension."""
    def one(sharding, dim):
        if dim is None:
            return sharding
        entries = list(tuple(sharding.spec) + (None,) * (dim + 1 - len(sharding.spec)))
        entries[dim] = as_candidate((*mesh_axes_of(entries[dim]), ax.STAGE))
        return NamedSharding(sharding.mesh, PartitionSpec(*entries),
                             memory_kind=sharding.memory_kind)
    return jax.tree.map(one, shardings, dims, is_leaf=lambda x: x is None or isinstance(
        x, NamedSharding))


def stage_dim(sharding) -> int | None:
    """The dimension a leaf's stored block splits over `stage` (None: replicated over it)."""
    spec = sharding.spec
    return next((i for i, entry in enumerate(spec) if ax.STAGE in mesh_axes_of(entry)), None)


def gather(stored: dict, shardings: dict, syncs: dict) -> dict:
    """Inside the step's shard_map (manual over `stage`): each shared leaf whole over
    `stage` (block leaves untouched), on each device's block of the axes GSPMD partitions
    (`grad_sync.on_shards`: left to GSPMD, it gathered a tensor-split table whole first)."""
    def one(path, x, sharding, sync):
        dim = None if is_blocks(path[0]) else stage_dim(sharding)
        if dim is None:
            return x
        return gs.on_shards(lambda b: jax.lax.all_gather(b, ax.STAGE, axis=dim, tiled=True),
                            x, sync)
    return jax.tree_util.tree_map_with_path(one, stored, shardings, syncs)


def reduce(grads: dict, shardings: dict, syncs: dict) -> dict:
    """The shared leaves' gradients (whole over `stage`, each stage's own contribution)
    summed over `stage`, into each leaf's stored split over it."""
    def one(x, sharding, sync):
        if x is None:  # frozen (LoRA's base): no gradient
            return None
        dim = stage_dim(sharding)
        if dim is None:
            return jax.lax.psum(x, ax.STAGE)
        return gs.on_shards(lambda b: jax.lax.psum_scatter(
            b, ax.STAGE, scatter_dimension=dim, tiled=True), x, sync)
    return jax.tree.map(one, grads, shardings, syncs, is_leaf=lambda x: x is None)
