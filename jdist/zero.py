"""ZeRO stages over the `data` axis.

`fsdp` always shards parameters, gradients and optimizer state over itself (by the rules).
`--zero N` additionally shards over `data`: 1 = optimizer state, 2 = + gradients (reduced
with a reduce-scatter into a sharded accumulator), 3 = + parameters (so `dp=8 --zero 3`
lays out state exactly like `fsdp=8`). Each array gains `data` on one dimension, chosen
by `zero_spec`; everything else about its sharding is unchanged.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jdist import axes as ax
from jdist.rules import mesh_axes_of

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

    preferred = [i for i, name in enumerate(names) if name in (ax.EMBED, ax.NORM)]
    by_size = sorted(range(len(shape)), key=lambda i: -shape[i])
    return next((i for i in preferred + by_size if splits(i)), None)


def zero_spec(shape: tuple[int, ...], spec: PartitionSpec, names: tuple, mesh) -> PartitionSpec:
    """`spec` with `data` appended (innermost) on the `zero_dim`: the layout a tiled
    reduce-scatter over `data` produces from a block sharded as `spec`."""
    dim = zero_dim(shape, spec, names, mesh)
    if dim is None:
        return spec
    entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
    parts = mesh_axes_of(entries[dim]) + (ax.DATA,)
    entries[dim] = parts[0] if len(parts) == 1 else parts
    return PartitionSpec(*entries)


def zero_shardings(abstract: dict, base: dict, names: dict, mesh) -> dict:
    """Sharded-over-data counterparts of the parameter shardings `base`."""
    return jax.tree.map(
        lambda leaf, s, n: NamedSharding(mesh, zero_spec(leaf.shape, s.spec, n, mesh)),
        abstract, base, names, is_leaf=lambda x: isinstance(x, tuple))


def reduce_over_data(per_replica: dict, base: dict, reduced: dict, mesh) -> dict:
    """Mean of per-replica gradients [n_data, ...] over `data`, written as explicit
    collectives: an all-reduce where `reduced` keeps a leaf replicated over data, a tiled
    reduce-scatter where `reduced` shards it (ZeRO-2/3), so each device receives only its
    slice and never holds the full reduced gradient."""
    n = mesh.shape[ax.DATA]
    if n == 1:  # nothing to reduce: skip the trivial (one-device-group) all-reduce
        return jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g[0], s),
                            per_replica, reduced)

    def one(g, base_sh: NamedSharding, out_sh: NamedSharding):
        in_spec = PartitionSpec(ax.DATA, *base_sh.spec)
        if out_sh.spec == base_sh.spec:
            body = lambda x: jax.lax.psum(x[0], ax.DATA) / n
        else:
            dim = next(i for i, e in enumerate(out_sh.spec) if ax.DATA in mesh_axes_of(e))
            body = lambda x: jax.lax.psum_scatter(
                x[0], ax.DATA, scatter_dimension=dim, tiled=True) / n
        return jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_sh.spec)(g)

    return jax.tree.map(one, per_replica, base, reduced)
