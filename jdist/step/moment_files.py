"""`--offload disk`: the optimizer's moments in `.npy` files on local disk (`np.memmap`), one
file per moment leaf, global shape (single process). Between steps the state's `opt_state`
is the optimizer's own tree whose moment leaves are these memmaps and whose scalars (the
update counts) are device arrays: the tree, and so checkpoints, match every other mode's.
The update reads and writes one layer's rows at a time (`jdist.step.disk_update`)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
from jax.tree_util import DictKey, keystr, tree_flatten_with_path

from jdist.spmd import axes as ax

DIR_NAME = "optimizer_state"  # under the run directory unless --offload-dir says where


def directory(offload_dir: str, run_dir) -> Path:
    """`--offload-dir`, else RUN_DIR/optimizer_state."""
    return Path(offload_dir) if offload_dir else Path(run_dir) / DIR_NAME


def on_devices(tree):
    """`tree` without its files (None in their place): what lives on the devices, e.g. for
    the replica check (a file has one copy)."""
    return jax.tree.map(lambda x: None if isinstance(x, np.memmap) else x, tree)


def param_key(state_path) -> str | None:
    """The parameter a moment leaf belongs to (`keystr` of its path's trailing dict keys:
    the optimizer state holds trees shaped like the parameters, under optax's tuples and
    named fields, and under Muon's partition's own dict), None for a scalar leaf."""
    first = len(state_path)
    while first and isinstance(state_path[first - 1], DictKey):
        first -= 1
    return None if first == len(state_path) else keystr(state_path[first:])


def stacked_keys(plan) -> dict[str, int]:
    """Parameters stacked over layers (their first logical axis `layers`): key -> layers."""
    names = dict(tree_flatten_with_path(plan.names, is_leaf=lambda x: isinstance(x, tuple))[0])
    shapes = tree_flatten_with_path(plan.abstract.params)[0]
    return {keystr(p): s.shape[0] for p, s in shapes if names[p][:1] == (ax.LAYERS,)}


def file_bytes(abstract_opt_state) -> int:
    """Bytes of all the moment files (global shapes: one copy, whatever the mesh)."""
    return sum(a.size * a.dtype.itemsize for p, a in
               tree_flatten_with_path(abstract_opt_state)[0] if param_key(p) is not None)


def file_name(state_key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", ".", state_key).strip(".") + ".npy"


def to_disk(opt_state, directory: Path, stacked: dict[str, int]):
    """`opt_state` (device arrays) with each moment leaf written to its file under
    `directory` (a layer's rows at a time for stacked parameters) and replaced by the file's
    memmap; the scalars stay as they are. Written to `NAME.tmp` and renamed, so a file that
    exists is whole."""
    def one(path, leaf):
        key = param_key(path)
        if key is None:
            return leaf
        return write(leaf, directory / file_name(keystr(path)), key in stacked)
    return jax.tree_util.tree_map_with_path(one, opt_state)


def create(abstract_opt_state, directory: Path) -> dict[str, np.memmap]:
    """A new file for each moment leaf (state key -> its memmap, zeros) under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    return {keystr(p): np.lib.format.open_memmap(directory / file_name(keystr(p)), "w+",
                                                 np.dtype(a.dtype), a.shape)
            for p, a in tree_flatten_with_path(abstract_opt_state)[0]
            if param_key(p) is not None}


def write(leaf, final: Path, by_layer: bool) -> np.memmap:
    """`leaf` in the file `final` (through `NAME.tmp`, a layer's rows at a time if
    `by_layer`), as its memmap."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_suffix(".tmp")
    out = np.lib.format.open_memmap(tmp, "w+", np.dtype(leaf.dtype), leaf.shape)
    for rows in (range(leaf.shape[0]) if by_layer else [Ellipsis]):
        out[rows] = np.asarray(leaf[rows])
    out.flush()
    del out
    tmp.rename(final)
    return np.lib.format.open_memmap(final, "r+")


def moments(opt_state) -> dict[str, np.memmap]:
    """state key -> memmap of every moment leaf."""
    return {keystr(p): x for p, x in tree_flatten_with_path(opt_state)[0]
            if isinstance(x, np.memmap)}


def as_arrays(tree):
    """`tree` with each memmap seen as a plain array over the same file (no copy), as
    Orbax saves it: a save of it must finish before the next step rewrites the files."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, np.memmap) else x, tree)
