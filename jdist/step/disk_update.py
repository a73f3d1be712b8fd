"""The optimizer update of `--offload disk`, one layer at a time: for each group of the walk
(`jdist.step.layer_walk`: a layer, one per stage under pp; then once the parameters outside
the stacks) its optimizer state (AdamW's moments, Muon's momentum) is read from its files
(`jdist.step.moment_files`), put on the devices in that group's sharding, updated by the
project's optimizer on the group's slice (`layer_walk.group_update`: the same numbers as
the whole-tree update) with the gradients clipped by the global norm the step took, and
written back; the parameters stay on the devices and are updated in place. The next
group's read runs on a thread while the current one updates."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import keystr, tree_flatten_with_path

from jdist.spmd.sharding import replicated
from jdist.step import layer_walk, muon_cost
from jdist.step.moment_files import create, param_key
from jdist.step.state import TrainState, init_params


def slice_sharding(sharding: NamedSharding, layer_entry) -> NamedSharding:
    """A moment's sharding for its group's rows (`layer_walk.take`): the layer axis split as
    the parameter's (`layer_entry`), the rest as the moment's."""
    return NamedSharding(sharding.mesh, PartitionSpec(layer_entry, *tuple(sharding.spec)[1:]))


class LayerUpdate:
    """`update(params, grads, opt_state, grad_norm) -> params`: the walk, on `plan`."""

    def __init__(self, plan):
        self.plan, self.walk = plan, layer_walk.groups(plan)
        self.stacked = layer_walk.stacks(plan)
        leaves = tree_flatten_with_path(plan.opt_device_shardings)[0]
        self.shardings = {keystr(p): s for p, s in leaves}
        self.param_of = {keystr(p): param_key(p) for p, _ in leaves}
        layer_axis = {keystr(p): (tuple(s.spec) + (None,))[0]
                      for p, s in tree_flatten_with_path(plan.shardings.params)[0]}
        self.rows_sharding = {k: slice_sharding(s, layer_axis[self.param_of[k]])
                              for k, s in self.shardings.items()
                              if self.param_of[k] in self.stacked}
        self.io = {"read_bytes": 0, "read_s": 0.0, "write_bytes": 0, "write_s": 0.0}
        self.programs: dict = {}
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="jdist-moments")

    def moment_keys(self, members) -> list[str]:
        return [k for k, p in self.param_of.items() if p in members]

    def rows(self, key: str, j):
        """The index of moment `key`'s group-j rows in its file (all of it for j None)."""
        return Ellipsis if j is None else slice(j, None, self.stacked[self.param_of[key]][1])

    def read(self, files: dict, j, members) -> dict:
        start = time.perf_counter()
        rows = {k: np.array(files[k][self.rows(k, j)]) for k in self.moment_keys(members)}
        self.io["read_s"] += time.perf_counter() - start
        self.io["read_bytes"] += sum(r.nbytes for r in rows.values())
        return rows

    def to_devices(self, rows: dict, whole: bool) -> dict:
        return {k: jax.device_put(r, self.moment_shardings(whole, (self.param_of[k],))[k])
                for k, r in rows.items()}

    def update(self, params, grads, opt_state, grad_norm):
        flat = tree_flatten_with_path(opt_state)[0]
        files = {keystr(p): x for p, x in flat if isinstance(x, np.memmap)}
        counts = {keystr(p): x for p, x in flat if not isinstance(x, np.memmap)}
        pending = self.reader.submit(self.read, files, *self.walk[0])
        for n, (j, members) in enumerate(self.walk):
            rows = pending.result()
            if n + 1 < len(self.walk):
                pending = self.reader.submit(self.read, files, *self.walk[n + 1])
            fn = self.compiled(j is None, members)
            params, moments, new_counts = fn(params, grads, self.to_devices(rows, j is None),
                                             counts, grad_norm, jnp.int32(j or 0))
            self.write(files, j, moments)
        for f in files.values():
            f.flush()
        done = {**counts, **new_counts}
        return params, jax.tree_util.tree_map_with_path(
            lambda p, x: files.get(keystr(p), done.get(keystr(p))), opt_state)

    def write(self, files: dict, j, moments: dict) -> None:
        start = time.perf_counter()
        for k, m in moments.items():
            rows = np.asarray(m)
            files[k][self.rows(k, j)] = rows
            self.io["write_bytes"] += rows.nbytes
        self.io["write_s"] += time.perf_counter() - start

    def abstract_args(self, whole: bool, members: tuple[str, ...]) -> tuple:
        """The arguments of `compiled(whole, members)`, abstract, with their shardings (to
        lower it for its memory: `benchmarks/offload.py`)."""
        plan, placed = self.plan, lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                    sharding=s)
        state = {keystr(p): v for p, v in tree_flatten_with_path(plan.abstract.opt_state)[0]}
        shardings = self.moment_shardings(whole, members)
        moments = {k: placed(jax.ShapeDtypeStruct(
            state[k].shape if whole else (self.stacked[self.param_of[k]][0],
                                          *state[k].shape[1:]), state[k].dtype), shardings[k])
            for k in self.moment_keys(members)}
        counts = {k: v for k, v in state.items() if self.param_of[k] is None}
        return (jax.tree.map(placed, plan.abstract.params, plan.shardings.params),
                jax.tree.map(placed, plan.abstract.params, plan.grad_shardings), moments,
                counts, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))

    def compiled(self, whole: bool, members: tuple[str, ...]):
        """The jitted update of one group: `members`' rows at a traced index (each group
        shape compiles once), or the parameters outside the stacks whole."""
        if (whole, members) not in self.programs:
            self.programs[whole, members] = self.program(whole, members)
        return self.programs[whole, members]

    def moment_shardings(self, whole: bool, members: tuple[str, ...]) -> dict:
        return {k: (s if whole else self.rows_sharding[k]) for k, s in self.shardings.items()
                if self.param_of[k] in members}

    def init_files(self, params, files: dict):
        """The optimizer's initial state with its moments in `files` (state key -> memmap),
        made a group at a time by the optimizer's own `init` on the group's slice of
        `params`: the whole moment tree is never on the devices."""
        counts = {}
        for j, members in self.walk:
            init = jax.jit(lambda params, i, j=j, members=members: {
                keystr(p): x for p, x in tree_flatten_with_path(self.plan.tx.init(
                    layer_walk.group(params, members, None if j is None else i,
                                     self.stacked)))[0]})
            for k, x in init(params, jnp.int32(j or 0)).items():
                if k in files:
                    files[k][self.rows(k, j)] = np.asarray(x)
                else:
                    counts[k] = x
        for f in files.values():
            f.flush()
        counts = jax.device_put(counts, replicated(self.plan.mesh))
        return jax.tree_util.tree_map_with_path(
            lambda p, _: files.get(keystr(p), counts.get(keystr(p))),
            self.plan.abstract.opt_state)

    def program(self, whole: bool, members: tuple[str, ...]):
        def update(params, grads, moments, counts, norm, j):
            params, state = layer_walk.group_update(
                self.plan.tx, params, grads, {**moments, **counts}, norm, members,
                None if whole else j, self.stacked)
            return (params, {k: state[k] for k in moments},
                    {k: v for k, v in state.items() if k not in moments})

        return jax.jit(update, donate_argnums=(0,), out_shardings=(
            self.plan.shardings.params, self.moment_shardings(whole, members),
            replicated(self.plan.mesh)))


def update_bytes(plan) -> int:
    """Per device, what the walk holds besides the parameters and gradients: the largest
    group's optimizer state in and out, and under Muon one group's share of the owned
    matrices whole (`muon_cost.update_bytes` counts all of a device's layers)."""
    walk = LayerUpdate(plan)
    state = max((sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                     for a in walk.abstract_args(j is None, members)[2].values())
                 for j, members in walk.walk), default=0)
    owned = muon_cost.update_bytes(plan.abstract.opt_state, plan.opt_device_shardings,
                                   dict(plan.mesh.shape), plan.names)
    return 2 * state + owned // max(len(walk.walk) - 1, 1)


def init_on_disk(plan, seed: int, directory) -> TrainState:
    """`init_state` for `--offload disk`: the parameters on the devices, the optimizer's
    initial moments in new files under `directory`, made a layer at a time."""
    params = init_params(plan, seed)
    opt_state = LayerUpdate(plan).init_files(params, create(plan.abstract.opt_state,
                                                             directory))
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), plan.shardings.step), params,
                      opt_state)
