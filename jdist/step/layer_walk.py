"""An optimizer update a group of layers at a time: the walk's groups, each group's slice of
a parameter-shaped tree, and the optimizer applied to that slice (`group_update`), which
gives the whole-tree update's numbers: AdamW is elementwise and Muon orthogonalises each
matrix (layer, expert) alone. Used by `--offload disk` (`jdist.step.disk_update`) and by
`--offload params` under Muon (`jdist.step.device_walk`, in chunks of owner layers).

Group j of a stack of n layers walked s at a time is rows j, j + n/s, ..., (s rows). For
`--offload disk` s = k * c: k devices split the layer axis (1, or the pp stages), so each
holds c rows of every group and no row moves between them; c is 1 for AdamW (one layer at a
time: the least memory) and under Muon as many layers as Muon's owner layout spreads over
the rest of the mesh (`chunk`), so each device orthogonalises one layer's matrices whole per
group, as the whole-tree update does, instead of XLA gathering a matrix split over fsdp or
tensor in every product of the iteration (llama3-8b fsdp=8, H100 compiler: 8.4 GiB of
all-gathers per layer, where a group of 8 moves 4.9 GiB by all-to-all). A slice keeps the
layer axis (size s), so the optimizer sees the parameters' logical axes (Muon's matrices
come from them)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.tree_util import keystr, tree_flatten_with_path
from optax.contrib import MuonDimensionNumbers

from jdist.spmd import axes as ax
from jdist.step.muon import owner_axes


def stacks(plan) -> dict[str, tuple[int, int]]:
    """Parameters stacked over layers (first logical axis `layers`): key -> (s rows per
    group, n / s groups); s = k devices that split the layer axis x c layers of each (1 for
    AdamW; under Muon `chunk` of the rest of the mesh)."""
    names = dict(tree_flatten_with_path(plan.names, is_leaf=lambda x: isinstance(x, tuple))[0])
    shardings = dict(tree_flatten_with_path(plan.shardings.params)[0])
    muon = bool(optax.tree_utils.tree_get_all_with_path(plan.abstract.opt_state, "MuonState"))
    out = {}
    for p, a in tree_flatten_with_path(plan.abstract.params)[0]:
        if names[p][:1] == (ax.LAYERS,):
            entry = axis_names((tuple(shardings[p].spec) + (None,))[0])
            k = math.prod(plan.mesh.shape[n] for n in entry)
            rest = {n: size for n, size in plan.mesh.shape.items() if n not in entry}
            split = k * (chunk(a.shape[0] // k, rest) if muon else 1)
            out[keystr(p)] = (split, a.shape[0] // split)
    return out


def chunk(layers: int, mesh_shape: dict) -> int:
    """Layers per walk step: those Muon's owner layout puts one per device (or a divisor)."""
    axes = owner_axes((layers,), MuonDimensionNumbers((), ()), mesh_shape)[0] or ()
    return math.prod(mesh_shape[a] for a in axes)


def axis_names(entry) -> tuple:
    """The mesh axes of a PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def groups(plan) -> list[tuple[int | None, tuple[str, ...]]]:
    """The walk: (j, the stacked parameters that have a row j per device) for each j, then
    (None, the parameters outside the stacks)."""
    stacked = stacks(plan)
    rest = tuple(keystr(p) for p, _ in tree_flatten_with_path(plan.abstract.params)[0]
                 if keystr(p) not in stacked)
    per = max((n for _, n in stacked.values()), default=0)
    return [(j, tuple(k for k, (_, n) in stacked.items() if n > j)) for j in range(per)] + \
        [(None, rest)]


def take(x, split: int, j):
    """Rows j, j + n/split, ... of a stacked array (a traced j), as (split, ...)."""
    return x.reshape(split, -1, *x.shape[1:])[:, j]


def put(x, split: int, j, rows):
    """`x` with `take(x, split, j)` replaced by `rows`."""
    return x.reshape(split, -1, *x.shape[1:]).at[:, j].set(rows).reshape(x.shape)


def nest(flat: dict) -> dict:
    """{path of DictKeys: leaf} as the nested dict those paths name."""
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k.key, {})
        node[path[-1].key] = leaf
    return out


def group(tree, members, j, stacked: dict, f=lambda x: x) -> dict:
    """`tree`'s (parameter-shaped) `members`, whole (j None) or their group-j rows, each
    through `f`, as a pruned tree: its paths are the whole tree's, so the optimizer's masks
    and Muon's logical names apply."""
    flat = {keystr(p): (p, x) for p, x in tree_flatten_with_path(tree)[0]}
    return nest({flat[k][0]: f(flat[k][1] if j is None else take(flat[k][1], stacked[k][0], j))
                 for k in members})


def clipped(g, norm, max_norm: float):
    """`optax.clip_by_global_norm`'s formula (optax 0.2.8, with jax 0.10.2 and 0.12), given
    the norm: divided by it, then multiplied, so a layer's clipped gradient rounds as the
    whole tree's does (a factor clip / norm differs in the last bit, which AdamW's first
    steps carry to the parameters)."""
    return jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


def group_update(tx, params, grads, state: dict, norm, members, j, stacked: dict,
                 bring=lambda x: x, back=lambda x: x):
    """One group's update by a `HostUpdate` `tx` (`jdist.step.optim`): `state` maps the
    group's optimizer-state keys (`keystr` of the whole state's paths) to their leaves, the
    moments sliced as the group, the counts whole. Returns (`params` with the group's rows
    updated, the new state by the same keys). `bring` and `back`: how a slice of `params`
    and `grads` comes to where the update runs, and the new rows go back (`--offload
    params`, whose trees are in host memory: to the device and back, `jdist.step.device_walk`)."""
    sub_p = group(params, members, j, stacked, bring)
    sub_g = group(grads, members, j, stacked,
                  lambda g: clipped(bring(g), norm, tx.clip_norm))
    old = jax.tree_util.tree_map_with_path(lambda p, _: state[keystr(p)],
                                           jax.eval_shape(tx.init, sub_p))
    updates, new_state = tx.update(sub_g, old, sub_p)
    new = {keystr(p): x for p, x in tree_flatten_with_path(
        optax.apply_updates(sub_p, updates))[0]}
    flat, treedef = tree_flatten_with_path(params)
    out = [x if keystr(p) not in new else back(new[keystr(p)]) if j is None else
           put(x, stacked[keystr(p)][0], j, back(new[keystr(p)])) for p, x in flat]
    return treedef.unflatten(out), {keystr(p): x for p, x in
                                    tree_flatten_with_path(new_state)[0]}
