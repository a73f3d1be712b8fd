"""Checkpoint restore: a saved TrainState read straight into any mesh's layout (each
process reads only its shards), one array alone (a partial restore, for tools that walk a
checkpoint), and setting aside the unusable checkpoints `latest_good` passed over."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import jax

from jdist.checkpoint.integrity import META, STATE, Found, _files, _mib, _say, move_aside


def abstract_target(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the *new* shardings: Orbax reads each shard where it goes."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)


def restore(path: Path, abstract: Any, shardings: Any) -> tuple[dict, dict]:
    """Restore the state saved at `path` laid out as `shardings` (any mesh, any process
    count); returns (state as a dict of its fields, metadata)."""
    import orbax.checkpoint as ocp

    start = time.perf_counter()
    target = abstract_target(abstract, shardings)
    target = target._asdict() if hasattr(target, "_asdict") else target
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        out = ckptr.restore(path.absolute(), args=ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}))
    state = jax.block_until_ready(out[STATE])
    size = sum(p.stat().st_size for p in _files(path).values())
    mesh = next(iter(jax.tree.leaves(shardings,
                                     is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))).mesh
    layout = " ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "single device"
    _say(f"restored step {out[META]['step']} from {path} ({_mib(size)}) onto mesh {layout} "
         f"in {time.perf_counter() - start:.2f}s")
    return state, out[META]


def restore_only(path: Path, abstract: Any, shardings: Any, only) -> dict:
    """The leaves of the state saved at `path` whose key paths `only(path)` accepts, laid out
    as `shardings`; every other leaf is left unread (Orbax's PLACEHOLDER in its place). A
    dict of the state's fields, as `restore`'s."""
    import orbax.checkpoint as ocp

    target = abstract_target(abstract, shardings)
    target = target._asdict() if hasattr(target, "_asdict") else target
    item = jax.tree_util.tree_map_with_path(
        lambda p, t: t if only(p) else ocp.PLACEHOLDER, target)
    args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(
        sharding=t.sharding, global_shape=t.shape, dtype=t.dtype)
        if isinstance(t, jax.ShapeDtypeStruct) else t, item)
    return ocp.PyTreeCheckpointer().restore((path / STATE).absolute(), args=ocp.args.PyTreeRestore(
        item=item, restore_args=args))


def restore_leaf(path: Path, keys: tuple[str, ...], abstract: jax.ShapeDtypeStruct,
                 sharding: jax.sharding.Sharding):
    """One array of the state saved at `path` (e.g. ("params", "embed")), alone: an Orbax
    partial restore reads only its files, so tools can walk a checkpoint one array at a
    time without holding the rest."""
    import orbax.checkpoint as ocp

    item = jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=sharding)
    args = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=abstract.shape,
                                dtype=abstract.dtype)
    nest = lambda leaf: functools.reduce(lambda tree, k: {k: tree}, reversed(keys), leaf)
    out = ocp.PyTreeCheckpointer().restore(
        (path / STATE).absolute(), args=ocp.args.PyTreeRestore(
            item=nest(item), restore_args=nest(args), partial_restore=True))
    return functools.reduce(lambda tree, k: tree[k], keys, out)


def set_aside(found: Found, root: Path) -> None:
    """Move the unusable checkpoints passed over by `latest_good` out of the checkpoint root
    (to ROOT.bad/), so new saves can reuse their step numbers. Call on every process."""
    from jax.experimental import multihost_utils

    bad = [p for p, _ in found.skipped if p.parent == root]
    if not bad:
        return
    multihost_utils.sync_global_devices("jdist checkpoint: validated")
    if jax.process_index() == 0:
        for p in bad:
            move_aside(p, root)
    multihost_utils.sync_global_devices("jdist checkpoint: set aside")
