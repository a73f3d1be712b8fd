"""Silent data corruption: replicas that should hold the same bits, and a step that should
compute the same bits twice.

Every device's shard of every array leaf gets a fingerprint computed on the device
(`fingerprints`): two wrapping uint32 sums of the shard's bit patterns, the plain sum and
one with each position weighted by its own odd constant. A single flipped bit changes its
element by +-2^j (j < 32) and so each sum by +-2^j or +-c*2^j mod 2^32, never 0 (c is odd,
so invertible mod 2^32); the weighted sum also sees most reorderings. The [devices,
leaves, 2] table is replicated, so every process reads all of it and reaches the same
verdict: every process must call these functions (they are collectives)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jdist.errors import ConfigError, require
from jdist.spmd.axes import SHORT

STRIDE = (2 * 0x9E3779B1) % 2**32  # weights i*STRIDE + 1: odd, and unlike for neighbours


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Where copies that must be bitwise equal are not: the first such leaf."""

    leaf: str                 # e.g. "params/blocks/attn/wq"
    devices: tuple[int, ...]  # device ids that disagree (all copies when there is no majority)
    processes: tuple[int, ...]
    replicas: tuple[str, ...]  # mesh coordinates on the replicated axes, e.g. ("dp=3",)
    copies: int               # how many copies were compared
    majority: bool            # whether a majority singled out the odd copies
    n_leaves: int = 1         # how many leaves disagree in all
    what: str = "replica"     # or "recompute": two runs of the same step

    def message(self) -> str:
        devs = ("device " if len(self.devices) == 1 else "devices ") + \
            ",".join(map(str, self.devices))
        procs = sorted(set(self.processes))
        procs = ("process " if len(procs) == 1 else "processes ") + ",".join(map(str, procs))
        more = f" (and {self.n_leaves - 1} more leaves)" if self.n_leaves > 1 else ""
        if self.what == "recompute":
            where = f"between two runs of the same step ({procs}, {devs})"
        elif self.majority:
            where = (f"on replica {' '.join(self.replicas)} ({procs}, {devs}) "
                     f"from the other {self.copies - len(self.replicas)} replicas")
        else:
            where = (f"between replicas {' and '.join(self.replicas)} ({procs}, "
                     f"{devs}); {self.copies} copies, no majority")
        return f"silent data corruption: {self.leaf} differs {where}{more}"

    def metrics(self) -> dict:
        return {"sdc": 1, "sdc_leaf": self.leaf, "sdc_devices": list(self.devices),
                "sdc_replicas": list(self.replicas), "sdc_kind": self.what}


def path_name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def arrays(tree) -> list[tuple[str, jax.Array]]:
    """(path, leaf) for every array leaf (None leaves, frozen under LoRA, hold nothing)."""
    return [(path_name(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if isinstance(x, jax.Array)]


def bits(x: jax.Array) -> jax.Array:
    """The bit pattern of each element as uint32 (64-bit elements as two words)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = min(x.dtype.itemsize, 4) * 8
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}")).astype(jnp.uint32)


def fingerprint(x: jax.Array) -> jax.Array:
    b = bits(x).reshape(-1)
    weights = jnp.arange(b.size, dtype=jnp.uint32) * jnp.uint32(STRIDE) + jnp.uint32(1)
    return jnp.stack([jnp.sum(b, dtype=jnp.uint32), jnp.sum(b * weights, dtype=jnp.uint32)])


def spec_of(name: str, x: jax.Array, mesh) -> PartitionSpec:
    s = x.sharding
    require(isinstance(s, NamedSharding) and s.mesh == mesh,
            f"{name} is not laid out on the training mesh ({s}); the replica check needs "
            "every leaf as a NamedSharding of that mesh")
    return s.spec


@functools.lru_cache(maxsize=16)
def table_fn(mesh, specs: tuple, on_host: tuple):
    """One jitted computation for a tree layout: each device's row of fingerprints, then
    an all-gather (replicated output) so every process holds the whole table."""
    def local(*xs):
        return jnp.stack([fingerprint(x) for x in xs])[None] if xs else \
            jnp.zeros((1, 0, 2), jnp.uint32)

    every = PartitionSpec(mesh.axis_names)  # row r is mesh.devices.flat[r]
    kernel = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=every)

    def table(*xs):
        # Host-memory leaves (an offloaded optimizer) come to the device to be summed.
        xs = [jax.device_put(x, NamedSharding(mesh, s, memory_kind="device")) if h else x
              for x, s, h in zip(xs, specs, on_host)]
        return kernel(*xs)
    return jax.jit(table, out_shardings=NamedSharding(mesh, PartitionSpec()))


def fingerprints(leaves: list[tuple[str, jax.Array]], mesh) -> np.ndarray:
    """[n_devices, n_leaves, 2] uint32, on every process."""
    xs = [x for _, x in leaves]
    specs = tuple(spec_of(n, x, mesh) for n, x in leaves)
    on_host = tuple(x.sharding.memory_kind not in (None, "device") for x in xs)
    return np.asarray(table_fn(mesh, specs, on_host)(*xs))


def replicated_axes(x: jax.Array, mesh) -> list[str]:
    used = {a for part in x.sharding.spec if part is not None
            for a in ((part,) if isinstance(part, str) else part)}
    return [a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1]


def replica_name(device, axes: list[str], mesh) -> str:
    where = dict(zip(mesh.axis_names, np.argwhere(mesh.devices == device)[0]))
    return ",".join(f"{SHORT[a]}={where[a]}" for a in axes)


def copies(x: jax.Array, mesh) -> list[list[int]]:
    """Groups of mesh rows (flat device positions) that hold the same index of `x`."""
    row = {d: i for i, d in enumerate(mesh.devices.flat)}
    groups: dict = {}
    for d, index in x.sharding.devices_indices_map(x.shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        groups.setdefault(key, []).append(row[d])
    return [sorted(g) for g in groups.values() if len(g) > 1]


def odd_ones(prints: np.ndarray, group: list[int]) -> tuple[list[int], bool]:
    """The rows of `group` that disagree: those outside a strict majority, or all of them."""
    keys = [prints[r].tobytes() for r in group]
    top = max(set(keys), key=keys.count)
    if len(set(keys)) == 1:
        return [], True
    if 2 * keys.count(top) > len(keys):
        return [r for r, k in zip(group, keys) if k != top], True
    return list(group), False


def check_replicas(tree, mesh) -> Mismatch | None:
    """Compare every copy of every shard across the replicas that must hold it bitwise."""
    leaves = arrays(tree)
    table = fingerprints(leaves, mesh)
    found = []
    for i, (name, x) in enumerate(leaves):
        axes, bad, majority, n = replicated_axes(x, mesh), [], True, 0
        for group in copies(x, mesh):
            rows, ok = odd_ones(table[:, i], group)
            bad, majority, n = bad + rows, majority and ok, max(n, len(group))
        if bad:
            devs = [mesh.devices.flat[r] for r in bad]
            replicas = tuple(dict.fromkeys(replica_name(d, axes, mesh) for d in devs))
            found.append(Mismatch(name, tuple(d.id for d in devs),
                                  tuple(d.process_index for d in devs), replicas, n, majority))
    return dataclasses.replace(found[0], n_leaves=len(found)) if found else None


def inject_corruption(tree, mesh, path: str | None = None, bit: int | None = 0,
                      element: int = 0):
    """Test-only: `tree` with bit `bit` of element `element` flipped in one device's shard of
    one replicated leaf (`path`, or the first replicated one), on the last replica of its
    first replicated axis. Only the process owning that device changes anything. `bit=None`:
    the top mantissa bit, a flip the next updates cannot round away (a lowest-bit flip of a
    weight can vanish in the rounding of `w - lr * update`: seen on jax 0.10.2, tiny,
    dp=2,tp=2,pp=2, where the replicas were bitwise equal again one step later)."""
    leaves = [(n, x) for n, x in arrays(tree) if replicated_axes(x, mesh) and x.size]
    leaves = [(n, x) for n, x in leaves if path is None or n == path]
    if not leaves:
        raise ConfigError(f"mesh {dict(mesh.shape)} has no replicas to check: no leaf"
                          f"{' ' + path if path else ''} is replicated over an axis of size > 1")
    # A parameter-like leaf (floating, not a scalar) unless told otherwise: not the step.
    name, x = next(((n, x) for n, x in leaves if x.ndim and jnp.issubdtype(x.dtype, jnp.floating)),
                   leaves[0])
    axis = replicated_axes(x, mesh)[0]
    where = [0] * mesh.devices.ndim
    where[mesh.axis_names.index(axis)] = mesh.shape[axis] - 1
    target = mesh.devices[tuple(where)]
    kind = x.sharding.memory_kind
    if bit is None:
        bit = jnp.finfo(x.dtype).nmant - 1

    def shard(s):
        a = np.array(s.data)  # a copy: the result shares no buffer with `tree`
        if s.device == target:
            word = a.reshape(-1).view(f"uint{a.dtype.itemsize * 8}")
            word[element] ^= word.dtype.type(1 << bit)
        return jax.device_put(a, jax.sharding.SingleDeviceSharding(s.device, memory_kind=kind))
    bad = jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [shard(s) for s in x.addressable_shards])
    return jax.tree_util.tree_map_with_path(
        lambda p, v: bad if isinstance(v, jax.Array) and path_name(p) == name else v, tree)


@functools.lru_cache(maxsize=4)
def copier(shardings: tuple):
    # Fresh buffers, so that the step can donate one copy while the other survives. jnp.copy
    # says so explicitly (on jax 0.10.2 a jitted identity also returns new buffers, checked
    # by buffer pointer, but jit is free to forward an input returned unchanged).
    return jax.jit(lambda xs: [jnp.copy(x) for x in xs], out_shardings=list(shardings))


def copy_tree(tree):
    """A device copy of `tree` that shares no buffer with it."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, copier(tuple(x.sharding for x in leaves))(leaves))


def recompute_check(step_fn, state, batch, mesh=None):
    """Run `step_fn` (which donates its state) twice from the same state and compare all
    outputs bitwise: (new_state, metrics, Mismatch | None), the outputs of the second run.

    Both runs are compared leaf by leaf, so they must be bitwise reproducible. XLA CPU is
    (repeated steps gave identical bits on jax 0.10.2:
    docs/measurements.md#bitwise-reproducibility), so a difference is a fault, not
    reduction-order noise."""
    mesh = mesh or next(x for _, x in arrays(state)).sharding.mesh
    named = lambda out: arrays(out[0]) + arrays({"metrics": out[1]})
    # The first run's outputs are reduced to fingerprints before the second starts, so at
    # most one extra copy of the state exists at a time.
    first = named(step_fn(copy_tree(state), batch))
    a = fingerprints(first, mesh)
    del first
    second = step_fn(state, batch)
    names = named(second)
    b = fingerprints(names, mesh)
    bad = [i for i in range(a.shape[1]) if not np.array_equal(a[:, i], b[:, i])]
    if not bad:
        return (*second, None)
    rows = [r for r in range(a.shape[0]) if not np.array_equal(a[r, bad[0]], b[r, bad[0]])]
    devs = [mesh.devices.flat[r] for r in rows]
    return (*second, Mismatch(names[bad[0]][0], tuple(d.id for d in devs),
                              tuple(d.process_index for d in devs), (), 2, False,
                              n_leaves=len(bad), what="recompute"))
