"""Checkpoints: Orbax async sharded saves, integrity manifests, and restore onto any mesh.

Layout of a run's checkpoints (`RUN_DIR/checkpoints/`), one directory per step:

    <step>/state/...             the TrainState as an Orbax PyTree (OCDBT + zarr; no pickle)
    <step>/meta/metadata         JSON: step, data position, seed, run config, model, mesh
    <step>/jdist_manifest.json   size and sha256 of every other file, written by process 0
                                 after Orbax has committed the step

Orbax writes a step into a temporary directory and renames it when every process has
finished, so a killed save never leaves a `<step>` directory. The manifest is written
after that commit and is what makes a checkpoint *good*: a checkpoint without one (killed
between commit and manifest) or whose files do not match it (truncated, deleted, tampered)
is never restored. Old checkpoints are pruned only once a newer one is good, so the
newest `keep` good checkpoints always survive.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax

from jdist.errors import ConfigError

MANIFEST = "jdist_manifest.json"
MANIFEST_FORMAT = "jdist-checkpoint-manifest/1"
STATE, META = "state", "meta"
BAD_DIR_SUFFIX = ".bad"  # sibling of the checkpoint root; where unusable checkpoints are moved


@dataclasses.dataclass(frozen=True)
class Found:
    """A good checkpoint chosen for restore, and the newer ones that were passed over."""

    path: Path
    step: int
    meta: dict
    skipped: tuple[tuple[Path, str], ...] = ()


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"checkpoint: {message}", flush=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


# ----------------------------------------------------------------------------- integrity


def _files(path: Path) -> dict[str, Path]:
    return {str(p.relative_to(path)): p for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: Path, step: int) -> int:
    """Record size and sha256 of every file of a committed checkpoint; returns total bytes."""
    files = {rel: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for rel, p in _files(path).items()}
    total = sum(f["size"] for f in files.values())
    body = {"format": MANIFEST_FORMAT, "step": step, "total_bytes": total, "files": files}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path / MANIFEST)  # atomic: a manifest is either absent or whole
    return total


def validate(path: Path) -> str | None:
    """None if the checkpoint at `path` is complete and intact, else why it is not."""
    manifest = path / MANIFEST
    if not path.is_dir():
        return "not a directory"
    if not manifest.is_file():
        return f"no {MANIFEST} (its save never finished)"
    try:
        body = json.loads(manifest.read_text())
        files = body["files"]
        # Checked explicitly, not by `assert`: `python -O` must still validate.
        well_formed = body["format"] == MANIFEST_FORMAT and isinstance(files, dict) and files
    except (ValueError, KeyError, TypeError):
        well_formed = False
    if not well_formed:
        return f"{MANIFEST} is unreadable"
    for rel, want in files.items():
        p = path / rel
        if not p.is_file():
            return f"file {rel} is missing"
        if p.stat().st_size != want["size"]:
            return f"file {rel} has {p.stat().st_size} bytes, expected {want['size']} (truncated?)"
        if _sha256(p) != want["sha256"]:
            return f"file {rel} does not match its recorded sha256 (corrupted or modified)"
    return None


def read_meta(path: Path) -> dict:
    """The JSON metadata of a checkpoint (run config, step, data position)."""
    return json.loads((path / META / "metadata").read_text())


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed step directories under a checkpoint root, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def latest_good(root: Path) -> Found | None:
    """The newest good checkpoint under `root`, or None; remembers the bad ones passed over."""
    skipped = []
    for step, path in reversed(step_dirs(root)):
        problem = validate(path)
        if problem is None:
            return Found(path, step, read_meta(path), tuple(skipped))
        skipped.append((path, problem))
    if skipped:
        return Found(Path(), -1, {}, tuple(skipped))  # nothing usable, but something was there
    return None


def resolve_explicit(text: str, flag: str = "--resume") -> Found:
    """`--resume PATH`: a step directory, or a run/checkpoint directory meaning its newest
    step. It must be good: an explicit request never falls back."""
    path = Path(text)
    if path.is_dir() and not (path / MANIFEST).exists() and not (path / STATE).exists():
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = step_dirs(root)
        if not steps:
            raise ConfigError(f"{flag} {text}: no checkpoints found there; pass a checkpoint "
                              "directory such as RUN_DIR/checkpoints/100")
        path = steps[-1][1]
    if not path.exists():
        raise ConfigError(f"{flag} {text}: no such checkpoint; pass an existing checkpoint "
                          "directory")
    problem = validate(path)
    if problem is not None:
        raise ConfigError(f"{flag} {text}: checkpoint is not usable: {problem}; pass an "
                          "earlier checkpoint (or --resume auto to take the newest good one)")
    return Found(path, int(read_meta(path)["step"]), read_meta(path))


# ------------------------------------------------------------------------------ restore


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
        dest = root.parent / (root.name + BAD_DIR_SUFFIX)
        dest.mkdir(parents=True, exist_ok=True)
        for p in bad:
            p.rename(dest / f"{p.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    multihost_utils.sync_global_devices("jdist checkpoint: set aside")


# --------------------------------------------------------------------------------- save


class Checkpointer:
    """Asynchronous saves into `root` with an Orbax CheckpointManager (created on first use,
    so runs that never save create nothing). Keeps the newest `keep` good checkpoints."""

    def __init__(self, root: Path, keep: int = 3, use_async: bool = True):
        self.root, self.keep, self.use_async = Path(root).absolute(), max(1, keep), use_async
        self._manager = None
        self._finisher: threading.Thread | None = None
        self.last_blocked_s = 0.0
        self.last_saved: int | None = None

    def _get_manager(self):
        import orbax.checkpoint as ocp

        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None,  # pruning waits for the manifest; see _prune
                create=True, cleanup_tmp_directories=True,
                enable_async_checkpointing=self.use_async)
            self._manager = ocp.CheckpointManager(self.root, options=options,
                                                  item_names=(STATE, META))
        return self._manager

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving `state` as step `step`; returns once the arrays are copied off the
        devices (training may then overwrite them). Call on every process."""
        import orbax.checkpoint as ocp

        manager = self._get_manager()
        if self._already_saved(step, manager):
            return
        self._join_finisher()
        start = time.perf_counter()
        tree = state._asdict() if hasattr(state, "_asdict") else state
        saved = manager.save(step, args=ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(tree), META: ocp.args.JsonSave(meta)}))
        if not saved:
            raise ConfigError(f"checkpoint: Orbax declined to save step {step} in {self.root} "
                              f"(it holds steps {manager.all_steps()}); check that the "
                              "directory is writable, or choose a new --run-dir")
        self.last_blocked_s = time.perf_counter() - start
        self.last_saved = step
        self._finisher = threading.Thread(target=self._finish, args=(step, start),
                                          name=f"jdist-checkpoint-{step}", daemon=True)
        self._finisher.start()

    def _already_saved(self, step: int, manager) -> bool:
        """True if this checkpointer saved `step` and it is still there (e.g. the final save
        right after a periodic one). Orbax refuses any other step not newer than its latest:
        that is one line here, not its traceback."""
        if step == self.last_saved and step in manager.all_steps():
            return True
        latest = manager.latest_step()
        if latest is not None and step <= latest:
            raise ConfigError(f"checkpoint: cannot save step {step} in {self.root}: it already "
                              f"holds step {latest} (is another run using the same --run-dir?); "
                              "give each run its own --run-dir")
        return False

    def _finish(self, step: int, start: float) -> None:
        """Background: wait for Orbax to commit, then write the manifest and prune."""
        try:
            self._manager.wait_until_finished()
            if jax.process_index() != 0:
                return
            path = self.root / str(step)
            total = write_manifest(path, step)
            _say(f"saved step {step} to {path} ({_mib(total)}) in "
                 f"{time.perf_counter() - start:.2f}s "
                 f"(training blocked {self.last_blocked_s:.2f}s)")
            self._prune()
        except Exception as e:  # noqa: BLE001 - a failed save must not kill training
            print(f"checkpoint: saving step {step} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)

    def _prune(self) -> None:
        steps = step_dirs(self.root)
        good = [s for s, p in steps if (p / MANIFEST).is_file()]
        if len(good) <= self.keep:
            return
        oldest_kept = good[-self.keep]
        for s, p in steps:
            if s < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def _join_finisher(self) -> None:
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None

    def wait(self) -> None:
        """Block until the last save is committed and (on process 0) its manifest written."""
        if self._manager is not None:
            self._manager.wait_until_finished()
        self._join_finisher()
        if jax.process_count() > 1:
            # Only process 0 writes the manifest; without this barrier another process could
            # validate (and reject) the newest checkpoint before the manifest exists.
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jdist checkpoint: manifest written")

    def close(self) -> None:
        """Wait, then release the manager; the next save creates a fresh one (which re-reads
        the directory, e.g. after a rollback set checkpoints aside)."""
        self.wait()
        if self._manager is not None:
            self._manager.close()
            self._manager = None
