"""Straggler detection across processes. In SPMD every collective waits for the slowest
process, so every process sees the same wall time per step; what tells the slow one apart
is its *host* time per step: the step's wall time minus the time the host blocked waiting
for the devices' results (a fast process spends its extra time blocked in that wait).
Every `every` steps the processes exchange their mean host time over the window; a process
above `threshold` x the median of the others for `windows` consecutive windows is reported.

What this sees: slow data loading, a contended or throttled host CPU, a slow filesystem.
A slow *device* delays every process's wait alike; finding it takes a device trace
(`--profile-steps`), not host times.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import sys

import numpy as np

from jdist.errors import ConfigError

HOSTNAME_BYTES = 64
FLOOR_S = 0.01  # host times are compared with at least 10 ms per step: below that, the
# difference is bookkeeping (process 0 alone writes metrics), not a straggling host


def _allgather(x: np.ndarray) -> np.ndarray:
    """[processes, ...]: `x` from every process (a collective: every process must call)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def hostnames() -> list[str]:
    """Every process's host name, by process index (exchanged once, as fixed-size bytes)."""
    raw = socket.gethostname().encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
    rows = _allgather(np.frombuffer(raw, np.uint8))
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]


def parse_injection(text: str) -> tuple[int, float, int] | None:
    """`--inject-straggler PROCESS:SECONDS[:FROM_STEP]` -> (process, seconds, first slow
    step, 1 by default); "" -> None."""
    if not text:
        return None
    try:
        proc, seconds, *start = text.split(":")
        if len(start) > 1 or (start and int(start[0]) < 1):
            raise ValueError
        return int(proc), float(seconds), int(start[0]) if start else 1
    except ValueError:
        raise ConfigError(f"--inject-straggler {text!r}: expected PROCESS:SECONDS or "
                          "PROCESS:SECONDS:FROM_STEP, e.g. 1:0.5 or 0:0.2:20") from None


@dataclasses.dataclass
class Detector:
    """Call `add(host_seconds)` once per step on every process; it returns the reports (if
    any) of the window that step closed."""

    every: int
    threshold: float
    windows: int
    names: list[str]  # host name of each process
    _times: list[float] = dataclasses.field(default_factory=list)
    _slow_for: np.ndarray | None = None  # consecutive slow windows, per process

    def add(self, host_seconds: float) -> list[dict]:
        self._times.append(host_seconds)
        if len(self._times) < self.every:
            return []
        mine = np.float64(statistics.fmean(self._times))
        self._times.clear()
        return self.judge(_allgather(mine.reshape(1)).reshape(-1))

    def judge(self, means: np.ndarray) -> list[dict]:
        """The reports for one window's mean host time per process."""
        if self._slow_for is None:
            self._slow_for = np.zeros(len(means), int)
        reports = []
        for p, t in enumerate(means):
            others = np.delete(means, p)
            median = float(np.median(others)) if len(others) else float(t)
            slow = t > self.threshold * max(median, FLOOR_S)
            self._slow_for[p] = self._slow_for[p] + 1 if slow else 0
            if self._slow_for[p] == self.windows:  # once per slow spell
                reports.append({"process": p, "host": self.names[p], "seconds": float(t),
                                "median_s": median, "ratio": float(t / max(median, FLOOR_S))})
        return reports

    def message(self, r: dict) -> str:
        return (f"jdist: straggler: process {r['process']} on host {r['host']} took "
                f"{r['seconds'] * 1e3:.1f} ms of host time per step, {r['ratio']:.1f}x the "
                f"median of the others ({r['median_s'] * 1e3:.1f} ms), for {self.windows} "
                f"consecutive windows of {self.every} steps")


def say(detector: Detector, reports: list[dict], main: bool) -> None:
    if main:
        for r in reports:
            print(detector.message(r), file=sys.stderr, flush=True)
