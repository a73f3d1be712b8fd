"""Checkpoints: Orbax async sharded saves, integrity manifests, and restore onto any mesh.

Layout of a run's checkpoints (`RUN_DIR/checkpoints/`), one directory per step:

    <step>/state/...             the TrainState as an Orbax PyTree (OCDBT + zarr; no pickle)
    <step>/meta/metadata         JSON: step, data position, seed, run config, model, mesh
    <step>/jdist_manifest.json   size and sha256 of every other file and which process wrote
                                 it, written by process 0 after Orbax has committed the step

Who writes which file (Orbax 0.12.8, OCDBT): process k writes its shards under
`state/ocdbt.process_k/` and `state/array_metadatas/process_k`; process 0 (Orbax's primary
host) writes everything else, including the merged `state/manifest.ocdbt` and `state/d/`
that point into every process's files. Each process hashes the files it wrote right after
the commit, while they are still in its page cache, instead of process 0 re-reading them
all; with several processes each leaves its hashes in `<step>/jdist_manifest.process_k.json`
for process 0 to merge (and delete).

Orbax writes a step into a temporary directory and renames it when every process has
finished, so a killed save never leaves a `<step>` directory. The manifest is written
after that commit and is what makes a checkpoint *good*: a checkpoint without one (killed
between commit and manifest) or whose files do not match it (deleted or truncated: checked
on every resume; corrupted in place: checked with `full=True`, which re-hashes) is never
restored. Old checkpoints are pruned only once a newer one is good, so the newest `keep`
good checkpoints always survive. A save that fails is recorded, said once, and raised as
SaveFailed by `Checkpointer.wait()`; the next save retries.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import jax

from jdist.errors import ConfigError

MANIFEST = "jdist_manifest.json"
MANIFEST_FORMAT = "jdist-checkpoint-manifest/2"  # /2 added "process" to each file
READABLE_FORMATS = ("jdist-checkpoint-manifest/1", MANIFEST_FORMAT)
PARTIAL = "jdist_manifest.process_{}.json"  # one process's hashes, until process 0 merges them
STATE, META = "state", "meta"
BAD_DIR_SUFFIX = ".bad"  # sibling of the checkpoint root; where unusable checkpoints are moved
# Per-process directories and files of an OCDBT checkpoint (Orbax 0.12.8): ocdbt.process_1/,
# array_metadatas/process_1.
_PROCESS_PART = re.compile(r"(?:ocdbt\.)?process_(\d+)")
# hashlib releases the GIL, so files hash in parallel (OCDBT data files are ~2 GiB each).
HASH_THREADS = 4
# Generous: a barrier waits for the slowest process's hashing, and after a failure on
# another process for Orbax's own timeout first.
BARRIER_TIMEOUT_S = 1800
_SAVES = itertools.count()  # every process starts the same saves in the same order


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
    """Every file of a checkpoint but its manifests (as paths relative to it)."""
    return {str(p.relative_to(path)): p for p in sorted(path.rglob("*"))
            if p.is_file() and not p.name.startswith("jdist_manifest")}


def owner(rel: str, process_count: int) -> int:
    """The process that wrote file `rel` of a checkpoint saved by `process_count` processes."""
    for part in PurePosixPath(rel).parts:
        m = _PROCESS_PART.fullmatch(part)
        if m and int(m.group(1)) < process_count:
            return int(m.group(1))
    return 0  # the primary host writes everything that is not per-process


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_records(path: Path, process: int = 0, process_count: int = 1) -> dict[str, dict]:
    """Size and sha256 of the files of the checkpoint at `path` that `process` wrote."""
    mine = {rel: p for rel, p in _files(path).items() if owner(rel, process_count) == process}
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        hashes = dict(zip(mine, pool.map(_sha256, mine.values())))
    return {rel: {"size": p.stat().st_size, "sha256": hashes[rel], "process": process}
            for rel, p in mine.items()}


def _write_json(path: Path, body: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path)  # atomic: either absent or whole


def write_manifest(path: Path, step: int, records: dict[str, dict] | None = None,
                   processes: int = 1) -> int:
    """Write the manifest of the committed checkpoint at `path` from every process's
    `records` (hashed here, as one process, when None); returns its total bytes."""
    files = file_records(path) if records is None else dict(sorted(records.items()))
    total = sum(f["size"] for f in files.values())
    _write_json(path / MANIFEST, {"format": MANIFEST_FORMAT, "step": step,
                                  "processes": processes, "total_bytes": total, "files": files})
    return total


def write_partial(path: Path, process: int, records: dict | None, error: str | None) -> None:
    """One process's hashes (or why it has none), for process 0 to merge."""
    _write_json(path / PARTIAL.format(process),
                {"format": MANIFEST_FORMAT, "process": process, "files": records,
                 "error": error})


def read_partials(path: Path, process_count: int) -> tuple[dict[str, dict], list[str]]:
    """The hashes of processes 1.. from their partial manifests, and what is wrong with any."""
    records, problems = {}, []
    for k in range(1, process_count):
        try:
            body = json.loads((path / PARTIAL.format(k)).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"process {k} recorded no hashes ({_reason(e)})")
            continue
        if body.get("error") or not isinstance(body.get("files"), dict):
            problems.append(f"process {k}: {body.get('error') or 'no files'}")
        else:
            records.update(body["files"])
    return records, problems


def validate(path: Path, full: bool = False) -> str | None:
    """None if the checkpoint at `path` is complete and intact, else why it is not. Every
    file the manifest lists must exist with its recorded size (one stat a file: catches a
    deleted or truncated file); `full` also re-reads and re-hashes every file (catches a
    same-size corruption, at the cost of reading the whole checkpoint)."""
    manifest = path / MANIFEST
    if not path.is_dir():
        return "not a directory"
    if not manifest.is_file():
        return f"no {MANIFEST} (its save never finished)"
    try:
        body = json.loads(manifest.read_text())
        files = body["files"]
        # Checked explicitly, not by `assert`: `python -O` must still validate.
        well_formed = (body["format"] in READABLE_FORMATS and isinstance(files, dict)
                       and files and all("size" in f and "sha256" in f for f in files.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        well_formed = False
    if not well_formed:
        return f"{MANIFEST} is unreadable"
    for rel, want in files.items():
        p = path / rel
        if not p.is_file():
            return f"file {rel} is missing"
        if p.stat().st_size != want["size"]:
            return f"file {rel} has {p.stat().st_size} bytes, expected {want['size']} (truncated?)"
    for rel, want in files.items() if full else ():
        if _sha256(path / rel) != want["sha256"]:
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


def latest_good(root: Path, full: bool = False) -> Found | None:
    """The newest good checkpoint under `root`, or None; remembers the bad ones passed over.
    `full`: re-hash each candidate (see `validate`)."""
    skipped = []
    for step, path in reversed(step_dirs(root)):
        problem = validate(path, full)
        if problem is None:
            return Found(path, step, read_meta(path), tuple(skipped))
        skipped.append((path, problem))
    if skipped:
        return Found(Path(), -1, {}, tuple(skipped))  # nothing usable, but something was there
    return None


def resolve_explicit(text: str, flag: str = "--resume", full: bool = False) -> Found:
    """`--resume PATH`: a step directory, or a run/checkpoint directory meaning its newest
    step. It must be good (`full`: re-hashed, see `validate`): an explicit request never
    falls back."""
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
    problem = validate(path, full)
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
        for p in bad:
            _move_aside(p, root)
    multihost_utils.sync_global_devices("jdist checkpoint: set aside")


def _move_aside(path: Path, root: Path) -> None:
    dest = root.parent / (root.name + BAD_DIR_SUFFIX)
    dest.mkdir(parents=True, exist_ok=True)
    path.rename(dest / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")


# --------------------------------------------------------------------------------- save


def _reason(e: BaseException | str) -> str:
    """An exception as one short line. Orbax's can span many, and tensorstore's name the
    cause (e.g. "File too large") only at their end, after long paths: keep both ends."""
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    text = " ".join(text.split())
    return text if len(text) <= 400 else f"{text[:200]} ... {text[-195:]}"


class SaveFailed(Exception):
    """A save that did not leave a good checkpoint; raised by `Checkpointer.wait()`."""

    def __init__(self, step: int, root: Path, reason: str, last_good: int | None):
        self.step, self.root, self.reason, self.last_good = step, root, reason, last_good
        good = (f"the last good checkpoint is step {last_good}" if last_good is not None
                else "no good checkpoint has been saved yet")
        super().__init__(f"checkpoint: saving step {step} failed: {reason}; check that "
                         f"{root} is writable and has space; {good}")


class _OrbaxErrors(logging.Filter):
    """Drops the errors with a traceback through Orbax that Orbax logs (absl) when a save
    fails, once from every thread the error passes through, and asyncio's for each of its
    write futures: about 1,000 lines of stderr for one full disk, burying the one line that
    says what failed. The Checkpointer records the same error and says it (SaveFailed)."""

    def __init__(self, orbax_dir: str):
        super().__init__()
        self.orbax_dir = orbax_dir

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.levelno >= logging.ERROR and record.exc_info else None
        tb = exc.__traceback__ if exc is not None else None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(self.orbax_dir):
                return False
            tb = tb.tb_next
        return True


def _quiet_unraisable(previous):
    """sys.unraisablehook without asyncio's "Event loop is closed" from call_soon_threadsafe
    called by tensorstore: once one write of a save fails, Orbax closes the event loop that
    awaited them, and tensorstore reports each write that finishes after that (one to ~80
    tracebacks, as timing has it) with PyErr_WriteUnraisable. Everything else passes."""
    import asyncio.base_events

    def hook(args):
        tb = args.exc_traceback
        code = tb.tb_frame.f_code if tb is not None else None
        if not (args.exc_type is RuntimeError and code is not None
                and code.co_name == "call_soon_threadsafe"
                and code.co_filename == asyncio.base_events.__file__):
            previous(args)

    hook.jdist_quiet = True
    return hook


def _quiet_orbax_errors() -> None:
    """Leave reporting a failed save to the Checkpointer (see `_OrbaxErrors`)."""
    import orbax.checkpoint as ocp

    orbax_dir = os.path.dirname(os.path.dirname(ocp.__file__)) + os.sep
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
            logger.addFilter(_OrbaxErrors(orbax_dir))
    if not getattr(sys.unraisablehook, "jdist_quiet", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


class Checkpointer:
    """Asynchronous saves into `root` with an Orbax CheckpointManager (created on first use,
    so runs that never save create nothing). Keeps the newest `keep` good checkpoints.

    A save that fails (in `save()` or in the background) is recorded in `failure`, not
    raised there: training goes on, the next `save()` says it once and retries, and `wait()`
    raises it as SaveFailed while no later save has replaced it."""

    def __init__(self, root: Path, keep: int = 3, use_async: bool = True):
        self.root, self.keep, self.use_async = Path(root).absolute(), max(1, keep), use_async
        self._manager = None
        self._finisher: threading.Thread | None = None
        self.last_blocked_s = 0.0
        self.last_saved: int | None = None
        self.failure: SaveFailed | None = None  # of the most recent save, if it failed
        self._failure_told = False  # said by save() or raised by wait(): never twice

    @property
    def last_good(self) -> int | None:
        """The newest step under `root` whose manifest was written (not re-validated)."""
        try:
            good = [s for s, p in step_dirs(self.root) if (p / MANIFEST).is_file()]
        except OSError:
            return None
        return good[-1] if good else None

    def _get_manager(self):
        import orbax.checkpoint as ocp

        if self._manager is None:
            _quiet_orbax_errors()  # a failed save is said once, by SaveFailed
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

        self._join_finisher()
        if self.failure is not None:
            self._retry(step)
        try:
            manager = self._get_manager()
            if self._already_saved(step, manager):
                return
            problem = self._cannot_write()
            if problem is not None:
                return self._failed(step, problem)
            start = time.perf_counter()
            tree = state._asdict() if hasattr(state, "_asdict") else state
            saved = manager.save(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardSave(tree), META: ocp.args.JsonSave(meta)}))
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a full disk as Orbax writes metadata
            return self._failed(step, _reason(e))
        if not saved:
            raise ConfigError(f"checkpoint: Orbax declined to save step {step} in {self.root} "
                              f"(it holds steps {manager.all_steps()}); check that the "
                              "directory is writable, or choose a new --run-dir")
        self.last_blocked_s = time.perf_counter() - start
        self.last_saved = step
        self._finisher = threading.Thread(target=self._finish,
                                          args=(manager, step, start, next(_SAVES)),
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

    def _cannot_write(self) -> str | None:
        """Why Orbax could not create a step directory in `root`, or None. Checked before
        Orbax starts, because in Orbax 0.12.8 a save whose directory cannot be created fails
        in the background and leaves four non-daemon threads waiting 300 s for a signal that
        never comes: the process could not exit for five minutes."""
        problem = None
        if jax.process_index() == 0:  # Orbax's primary host creates the step directories
            try:
                Path(tempfile.mkdtemp(prefix=".jdist-write-check-", dir=self.root)).rmdir()
            except OSError as e:
                problem = _reason(e)
        if jax.process_count() > 1:
            # All or none: a process that skipped the save while the others entered Orbax's
            # would leave them waiting in its collectives.
            import numpy as np
            from jax.experimental import multihost_utils

            if multihost_utils.broadcast_one_to_all(np.int32(problem is not None)):
                problem = problem or f"process 0 cannot create a directory in {self.root}"
        return problem

    def _failed(self, step: int, reason: str) -> None:
        self.failure = SaveFailed(step, self.root, reason, self.last_good)
        self._failure_told = False

    def _retry(self, step: int) -> None:
        """The last save failed: say so (unless wait() raised it), set aside what it left
        of its step directory so that the step can be saved again, and start a fresh Orbax
        manager: in Orbax 0.12.8 the old one can still save, but it keeps the failed save's
        `<step>.orbax-checkpoint-tmp` directory (only a new manager cleans it up), may raise
        the failed save's error again when closed, and may still list a committed step that
        never got its manifest."""
        failure, self.failure, self.last_saved = self.failure, None, None
        if not self._failure_told and jax.process_index() == 0:
            print(f"{failure}; retrying with step {step}", file=sys.stderr, flush=True)
        self._failure_told = False
        left = self.root / str(failure.step)
        if jax.process_index() == 0 and left.is_dir() and not (left / MANIFEST).is_file():
            try:
                _move_aside(left, self.root)
            except OSError:
                pass  # still unwritable: the retry fails too, and says why
        if jax.process_count() > 1:  # no process lists the directory before it has moved
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jdist checkpoint: retry {step}")
        self._drop_manager(quiet=True)

    def _drop_manager(self, quiet: bool) -> None:
        """Close the manager; `quiet` after a failure, whose Orbax error closing may raise
        again (it is already recorded)."""
        manager, self._manager = self._manager, None
        if manager is None:
            return
        try:
            manager.close()
        except Exception:  # noqa: BLE001
            if not quiet:
                raise

    def _finish(self, manager, step: int, start: float, seq: int) -> None:
        """Background, on every process: wait for Orbax to commit, hash this process's
        files while they are in its page cache, then (process 0) write the manifest and
        prune. An error is recorded in `failure` for wait() and the next save()."""
        try:
            self._finish_save(manager, step, start, seq)
        except Exception as e:  # noqa: BLE001 - recorded; a failed save must not kill training
            self._failed(step, _reason(e))

    def _finish_save(self, manager, step: int, start: float, seq: int) -> None:
        pid, count = jax.process_index(), jax.process_count()
        path, records, error, total = self.root / str(step), None, None, 0
        try:
            manager.wait_until_finished()
            committed = time.perf_counter()
            records = file_records(path, pid, count)
        except Exception as e:  # noqa: BLE001 - recorded (and every process must go on)
            error = _reason(e)
        if count > 1:
            error, total = self._combine(path, step, seq, records, error)
        elif error is None:
            total = write_manifest(path, step, records)
        if error is not None:
            return self._failed(step, error)
        done = time.perf_counter()
        _say(f"saved step {step} to {path} ({_mib(total)}) in {done - start:.2f}s "
             f"(training blocked {self.last_blocked_s:.2f}s; committed by Orbax after "
             f"{committed - start:.2f}s, then hashed in {done - committed:.2f}s)")
        if pid == 0:
            try:
                self._prune()
            except OSError as e:  # the new checkpoint is good; the old ones wait for the next
                print(f"checkpoint: pruning old checkpoints failed: {_reason(e)}",
                      file=sys.stderr, flush=True)

    def _combine(self, path: Path, step: int, seq: int, records: dict | None,
                 error: str | None) -> tuple[str | None, int]:
        """Several processes: each leaves its hashes (or its error) in a partial manifest,
        all meet, process 0 merges them into the manifest, all meet again, so that every
        process knows whether the checkpoint is good when its wait() returns. The barriers
        are the distributed runtime's key-value barriers (Orbax's get_barrier_sync_fn, which
        Orbax itself uses from its background threads), safe here while the main thread runs
        the training step's collectives; multihost_utils.sync_global_devices is a device
        computation, and two threads launching them could order them differently on
        different processes. Every process goes through both barriers, even after an
        error, so that none waits for the timeout. Returns (error, total bytes)."""
        import orbax.checkpoint as ocp

        pid, count, total = jax.process_index(), jax.process_count(), 0
        sync = ocp.multihost.get_barrier_sync_fn()
        key = f"jdist_checkpoint_{zlib.crc32(str(self.root).encode())}_{step}_{seq}"
        try:
            if pid != 0:
                write_partial(path, pid, records, error)
        except OSError as e:
            error = error or _reason(e)
        try:
            sync(key=key + "_hashed", timeout_ms=BARRIER_TIMEOUT_S * 1000)
            if pid == 0 and error is None:
                others, problems = read_partials(path, count)
                if problems:
                    error = "; ".join(problems)
                else:
                    total = write_manifest(path, step, {**records, **others}, count)
                    for k in range(1, count):
                        (path / PARTIAL.format(k)).unlink(missing_ok=True)
            sync(key=key + "_manifest", timeout_ms=BARRIER_TIMEOUT_S * 1000)
        except Exception as e:  # noqa: BLE001 - a barrier timeout, an unwritable directory
            error = error or _reason(e)
        if error is None and not (path / MANIFEST).is_file():
            error = "process 0 did not write the manifest (see its output)"
        return error, total

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
        """Block until the last save is committed and its manifest written (on every
        process: with several, the manifest is written once all have hashed). Raises
        SaveFailed if that save failed, once: a later wait() or close() (say, in a
        `finally`) does not raise it again, and the next save() retries."""
        self._join_finisher()
        if self.failure is not None and not self._failure_told:
            self._failure_told = True
            raise self.failure

    def close(self) -> None:
        """Wait (raising SaveFailed as `wait` does), then release the manager; the next save
        creates a fresh one (which re-reads the directory, e.g. after a rollback set
        checkpoints aside)."""
        try:
            self.wait()
        finally:
            self._drop_manager(quiet=self.failure is not None)
