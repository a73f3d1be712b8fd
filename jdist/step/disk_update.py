"""The optimizer update of `--offload disk`, one layer at a time: for each layer (then once
for the parameters outside the stacks) its moments are read from their files
(`jdist.step.moment_files`), put on the devices in that layer's sharding, updated by the
project's optimizer (the elementwise `HostUpdate` chain, `jdist.step.optim`, on the layer's
slice of every tree: the same transform, so the same numbers as the whole-tree update) with
the gradients clipped by the global norm the step took, and written back; the parameters
stay on the devices and are updated in place. The next layer's read runs on a thread while
the current one updates."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import keystr, tree_flatten_with_path

from jdist.errors import require
from jdist.spmd.sharding import replicated
from jdist.step.moment_files import create, param_key, stacked_keys
from jdist.step.state import TrainState, init_params


def nest(flat: dict) -> dict:
    """{path of DictKeys: leaf} as the nested dict those paths name."""
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k.key, {})
        node[path[-1].key] = leaf
    return out


def clipped(g, norm, max_norm: float):
    """`optax.clip_by_global_norm`'s formula (optax 0.2.8, with jax 0.10.2 and 0.12), given
    the norm: divided by it, then multiplied, so a layer's clipped gradient rounds as the
    whole tree's does (a factor clip / norm differs in the last bit, which AdamW's first
    steps carry to the parameters)."""
    return jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


def groups(plan) -> list[tuple[int | None, tuple[str, ...]]]:
    """The update's walk: (layer, the stacked parameters that have it) for each layer, then
    (None, the parameters outside the stacks)."""
    stacked = stacked_keys(plan)
    rest = tuple(keystr(p) for p, _ in tree_flatten_with_path(plan.abstract.params)[0]
                 if keystr(p) not in stacked)
    layers = max(stacked.values(), default=0)
    return [(i, tuple(k for k, n in stacked.items() if n > i)) for i in range(layers)] + \
        [(None, rest)]


def slice_sharding(sharding: NamedSharding) -> NamedSharding:
    """A stacked leaf's sharding without its layer dimension (which must not be split)."""
    spec = tuple(sharding.spec) + (None,)
    require(spec[0] is None, "--offload disk reads the optimizer state a layer at a time, "
            "so the layer dimension cannot be split over devices; drop the rule that splits "
            "it (or pp from --mesh)")
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:-1]))


class LayerUpdate:
    """`update(params, grads, opt_state, grad_norm) -> params`: the walk, on `plan`."""

    def __init__(self, plan):
        self.plan, self.walk = plan, groups(plan)
        self.stacked = stacked_keys(plan)
        leaves = tree_flatten_with_path(plan.opt_device_shardings)[0]
        self.shardings = {keystr(p): s for p, s in leaves}
        self.param_of = {keystr(p): param_key(p) for p, _ in leaves}
        self.io = {"read_bytes": 0, "read_s": 0.0, "write_bytes": 0, "write_s": 0.0}
        self.programs: dict = {}
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="jdist-moments")

    def moment_keys(self, members) -> list[str]:
        return [k for k, p in self.param_of.items() if p in members]

    def read(self, files: dict, layer, members) -> dict:
        start = time.perf_counter()
        rows = {k: np.array(files[k] if layer is None else files[k][layer])
                for k in self.moment_keys(members)}
        self.io["read_s"] += time.perf_counter() - start
        self.io["read_bytes"] += sum(r.nbytes for r in rows.values())
        return rows

    def to_devices(self, rows: dict, layer) -> dict:
        pick = (lambda s: s) if layer is None else slice_sharding
        return {k: jax.device_put(r, pick(self.shardings[k])) for k, r in rows.items()}

    def update(self, params, grads, opt_state, grad_norm):
        flat = tree_flatten_with_path(opt_state)[0]
        files = {keystr(p): x for p, x in flat if isinstance(x, np.memmap)}
        counts = {keystr(p): x for p, x in flat if not isinstance(x, np.memmap)}
        pending = self.reader.submit(self.read, files, *self.walk[0])
        for n, (layer, members) in enumerate(self.walk):
            rows = pending.result()
            if n + 1 < len(self.walk):
                pending = self.reader.submit(self.read, files, *self.walk[n + 1])
            fn = self.compiled(layer is None, members)
            index = jnp.int32(layer or 0)
            params, moments, new_counts = fn(params, grads, self.to_devices(rows, layer),
                                             counts, grad_norm, index)
            self.write(files, layer, moments)
        for f in files.values():
            f.flush()
        done = {**counts, **new_counts}
        return params, jax.tree_util.tree_map_with_path(
            lambda p, x: files.get(keystr(p), done.get(keystr(p))), opt_state)

    def write(self, files: dict, layer, moments: dict) -> None:
        start = time.perf_counter()
        for k, m in moments.items():
            rows = np.asarray(m)
            if layer is None:
                files[k][...] = rows
            else:
                files[k][layer] = rows
            self.io["write_bytes"] += rows.nbytes
        self.io["write_s"] += time.perf_counter() - start

    def abstract_args(self, whole: bool, members: tuple[str, ...]) -> tuple:
        """The arguments of `compiled(whole, members)`, abstract, with their shardings (to
        lower it for its memory: `benchmarks/offload.py`)."""
        plan, placed = self.plan, lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                    sharding=s)
        state = dict(tree_flatten_with_path(plan.abstract.opt_state)[0])
        moments = {k: placed(jax.ShapeDtypeStruct(
            state_leaf.shape[0 if whole else 1:], state_leaf.dtype),
            self.shardings[k] if whole else slice_sharding(self.shardings[k]))
            for k in self.moment_keys(members)
            for state_leaf in [next(v for p, v in state.items() if keystr(p) == k)]}
        counts = {keystr(p): v for p, v in state.items() if param_key(p) is None}
        return (jax.tree.map(placed, plan.abstract.params, plan.shardings.params),
                jax.tree.map(placed, plan.abstract.params, plan.grad_shardings), moments,
                counts, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))

    def compiled(self, whole: bool, members: tuple[str, ...]):
        """The jitted update of one group: `members`' rows at a traced layer index (each
        layer compiles once), or the parameters outside the stacks whole."""
        if (whole, members) not in self.programs:
            self.programs[whole, members] = self.program(whole, members)
        return self.programs[whole, members]

    def group(self, tree, whole: bool, members: tuple[str, ...], i, f=lambda x: x) -> dict:
        """`tree`'s (parameter-shaped) `members`, whole or their row `i`, each through `f`, as
        a pruned tree: its paths are the whole tree's, so the optimizer's masks apply."""
        flat = {keystr(p): (p, x) for p, x in tree_flatten_with_path(tree)[0]}
        take = (lambda x: x) if whole else (lambda x: x[i])
        return nest({flat[k][0]: f(take(flat[k][1])) for k in members})

    def moment_shardings(self, whole: bool, members: tuple[str, ...]) -> dict:
        return {k: (s if whole else slice_sharding(s)) for k, s in self.shardings.items()
                if self.param_of[k] in members}

    def init_files(self, params, files: dict):
        """The optimizer's initial state with its moments in `files` (state key -> memmap),
        made a group at a time by the optimizer's own `init` on the group's slice of
        `params`: the whole moment tree is never on the devices."""
        counts = {}
        for layer, members in self.walk:
            whole = layer is None
            init = jax.jit(lambda params, i, whole=whole, members=members: {
                keystr(p): x for p, x in tree_flatten_with_path(self.plan.tx.init(
                    self.group(params, whole, members, i)))[0]})
            for k, x in init(params, jnp.int32(layer or 0)).items():
                if k not in files:
                    counts[k] = x
                elif whole:
                    files[k][...] = np.asarray(x)
                else:
                    files[k][layer] = np.asarray(x)
        for f in files.values():
            f.flush()
        counts = jax.device_put(counts, replicated(self.plan.mesh))
        return jax.tree_util.tree_map_with_path(
            lambda p, _: files.get(keystr(p), counts.get(keystr(p))),
            self.plan.abstract.opt_state)

    def program(self, whole: bool, members: tuple[str, ...]):
        tx = self.plan.tx

        def update(params, grads, moments, counts, norm, i):
            sub_p = self.group(params, whole, members, i)
            sub_g = self.group(grads, whole, members, i,
                               lambda g: clipped(g, norm, tx.clip_norm))
            given = {**moments, **counts}
            state = jax.tree_util.tree_map_with_path(
                lambda p, _: given[keystr(p)], jax.eval_shape(tx.init, sub_p))
            updates, state = tx.update(sub_g, state, sub_p)
            new_sub = optax.apply_updates(sub_p, updates)
            new = dict(tree_flatten_with_path(new_sub)[0])
            flat, treedef = jax.tree_util.tree_flatten_with_path(params)
            out = [new[p] if whole and p in new else
                   (x.at[i].set(new[p]) if p in new else x) for p, x in flat]
            out_state = {keystr(p): x for p, x in tree_flatten_with_path(state)[0]}
            return (treedef.unflatten(out), {k: out_state[k] for k in moments},
                    {k: v for k, v in out_state.items() if k not in moments})

        return jax.jit(update, donate_argnums=(0,), out_shardings=(
            self.plan.shardings.params, self.moment_shardings(whole, members),
            replicated(self.plan.mesh)))


def init_on_disk(plan, seed: int, directory) -> TrainState:
    """`init_state` for `--offload disk`: the parameters on the devices, the optimizer's
    initial moments in new files under `directory`, made a layer at a time."""
    params = init_params(plan, seed)
    opt_state = LayerUpdate(plan).init_files(params, create(plan.abstract.opt_state,
                                                             directory))
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), plan.shardings.step), params,
                      opt_state)
