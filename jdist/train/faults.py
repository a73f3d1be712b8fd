"""Fault handling inside the training loop: preemption signals (agreed on by every process),
the non-finite guard (`--on-nan skip|rollback|stop`), the debug NaN injection, and the exit
statuses of `python -m jdist.train`."""

from __future__ import annotations

import math
import signal
import sys
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from jdist.errors import (  # noqa: F401 - the exit statuses are part of this module's story
    EXIT_CONFIG,
    EXIT_CORRUPTION,
    EXIT_CRASH,
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_SAVE_FAILED,
)

MAX_ROLLBACKS = 8       # rollback gives up (like stop) after this many in one run


class Preempted(Exception):
    """Raised after the preemption checkpoint is safely written."""

    def __init__(self, step: int, signame: str):
        super().__init__(f"{signame} received: saved a checkpoint at step {step} and stopped; "
                         "run the same command again (--resume auto) to continue")
        self.step = step


class NonFinite(Exception):
    """A step's loss or gradient norm was not finite and the policy says stop."""


class Corruption(Exception):
    """Silent data corruption found by a health check (`jdist.train.health`): stop, keep the
    last good checkpoint (nothing after the last passing check was saved)."""


class Rollback(Exception):
    """Internal: restore the last good checkpoint and skip the batch of `step`."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def is_finite(record: dict) -> bool:
    return math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


def stopped(record: dict) -> NonFinite:
    """`--on-nan stop`: the error for a non-finite step's metrics record."""
    return NonFinite(f"step {record['step']}: loss {record['loss']} / gradient norm "
                     f"{record['grad_norm']} is not finite; stopped (--on-nan stop). Lower --lr "
                     "or raise --warmup, or pass --on-nan skip or rollback")


# ------------------------------------------------------------------- non-finite guard


def advance(state, plan):
    """Skip a batch on the host (after a rollback): count the step, change nothing else. Like
    a step under `jdist.step.optim.skip_nonfinite`, the optimizer's own count (so the
    learning-rate schedule, see `jdist.step.optim.updates_applied`) does not advance."""
    bump = jax.jit(lambda s: s + 1, out_shardings=plan.shardings.step)
    return state._replace(step=bump(state.step))


# -------------------------------------------------------------------------- preemption


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and stops. With several
    processes the flag is max-reduced over all of them, one step behind, so every process
    stops after the same step even if only one was signalled. A second signal aborts."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, mesh):
        self.received: str = ""
        self._previous: dict = {}
        self._mesh = mesh
        self._pending = None  # the agreed flag of the previous step (multi-process)
        self._agreed = False
        self._announced = False
        if jax.process_count() > 1:
            from jax.sharding import NamedSharding, PartitionSpec

            self._sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
            self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def _handle(self, signum, frame) -> None:
        # Only records the signal: writing to a stream here would re-enter a write the signal
        # interrupted (e.g. the progress line: "RuntimeError: reentrant call inside
        # <_io.BufferedWriter name='<stderr>'>", exit 1 instead of 75). `poll` announces it.
        if self.received:  # second signal: give up on the clean stop
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def _announce(self) -> None:
        if self.received and not self._announced:
            self._announced = True
            if jax.process_index() == 0:
                print(f"jdist: {self.received} received: finishing the current step and saving "
                      "a checkpoint (send again to abort)", file=sys.stderr, flush=True)

    def __enter__(self) -> Self:
        for s in self.SIGNALS:
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: no signal handling
                pass
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def poll(self) -> bool:
        """Call once per step, on every process; True when all processes should stop now."""
        self._announce()
        if jax.process_count() == 1:
            return bool(self.received)
        agreed = self._pending is not None and bool(self._pending)  # waits for last step's
        flag = np.int32(bool(self.received))
        n = self._sharding.mesh.devices.size
        flags = jax.make_array_from_callback((n,), self._sharding,
                                             lambda idx: np.full((1,), flag, np.int32))
        self._pending = self._reduce(flags)
        if agreed and not self.received:
            self.received = "SIGTERM (on another process)"
        return agreed


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
