"""Checkpoint saves: asynchronous sharded Orbax saves (`Checkpointer`), each finished in
the background by hashing the files every process wrote and writing the manifest that makes
the checkpoint good, then pruning to the newest `keep` good ones. A failed save is recorded
and raised once as SaveFailed (the next save retries), and Orbax's and tensorstore's own
reports of it are filtered out so that one line says what failed."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import jax

from jdist.checkpoint.integrity import (
    MANIFEST,
    META,
    PARTIAL,
    STATE,
    _mib,
    _reason,
    _say,
    file_records,
    move_aside,
    read_partials,
    step_dirs,
    write_manifest,
    write_partial,
)
from jdist.errors import ConfigError

# Generous: a barrier waits for the slowest process's hashing, and after a failure on
# another process for Orbax's own timeout first.
BARRIER_TIMEOUT_S = 1800
_SAVES = itertools.count()  # every process starts the same saves in the same order


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
                move_aside(left, self.root)
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
