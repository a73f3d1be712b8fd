"""Is a slowdown the system's or the numbers'? Every log interval (`--log-every` steps) the
run's throughput and loss are judged against the run's own history, into one verdict:

  "ok"
  "systems: throughput -35% vs median, loss normal"        (a slow host, link or device)
  "numerics/data: loss spike z=8.1, throughput steady"     (a bad batch, an unstable update)
  "both: throughput -35% vs median, loss spike z=8.1"

throughput  the interval's median tokens/s against the median of all earlier intervals'
            medians. Medians, so one slow step (a checkpoint save, a profiled step) is not a
            slowdown; all earlier intervals, so a lasting slowdown stays flagged until it is
            most of the run. A drop beyond DROP counts (on a host whose CPU cores are shared
            with other work, that work's coming and going does: it is a systems slowdown).
            Judged from the third interval on; the run's first step (first dispatch) is
            left out.
loss        the interval's highest step loss as a robust z-score against the WINDOW steps
            before it: (loss - median) / (1.4826 x median absolute deviation), which a
            falling loss never makes large. Above Z, or any non-finite loss, is an anomaly.
            Judged once MIN_LOSSES steps are known.
"""

from __future__ import annotations

import collections
import math
import statistics

DROP = 0.25  # a quarter below the median: well outside a dedicated machine's step-time noise
Z = 6.0
WINDOW = 100
MIN_LOSSES = 8
CODES = {"ok": 0, "systems": 1, "numerics/data": 2, "both": 3}  # TensorBoard's scalar


def throughput_change(now: float, earlier: list[float]) -> float | None:
    """now / median(earlier) - 1, or None with under 2 earlier values."""
    return now / statistics.median(earlier) - 1 if len(earlier) >= 2 else None


def robust_z(value: float, history: list[float]) -> float | None:
    if len(history) < MIN_LOSSES:
        return None
    mid = statistics.median(history)
    sigma = 1.4826 * statistics.median(abs(x - mid) for x in history)
    return (value - mid) / max(sigma, 1e-6 * abs(mid), 1e-12)


def verdict(change: float | None, z: float | None, finite: bool) -> str:
    slow = change is not None and change < -DROP
    odd = not finite or (z is not None and z > Z)
    systems = f"throughput {change:+.0%} vs median" if slow else ""
    loss = "loss not finite" if not finite else f"loss spike z={z:.1f}" if odd else ""
    if slow and odd:
        return f"both: {systems}, {loss}"
    if slow:
        return f"systems: {systems}, loss normal"
    if odd:
        steady = "throughput steady" if change is not None else "throughput not judged yet"
        return f"numerics/data: {loss}, {steady}"
    return "ok"


class Monitor:
    """Feed it every step's record in order (`add`); at the end of each interval it returns
    the fields to add to that record: `health` (the verdict), `health_code` (CODES),
    `throughput_change` and `loss_z` (None until judged)."""

    def __init__(self, every: int):
        self.every = max(1, every)
        self.losses: collections.deque = collections.deque(maxlen=WINDOW)
        self.medians: list[float] = []  # each earlier interval's median tokens/s
        self.interval: list[dict] = []
        self.first_step: int | None = None  # pays one-off costs: not a throughput sample

    def add(self, record: dict, last: bool = False) -> dict:
        self.first_step = record["step"] if self.first_step is None else self.first_step
        self.interval.append(record)
        if record["step"] % self.every and not last:
            return {}
        interval, self.interval = self.interval, []
        losses = [r["loss"] for r in interval]
        finite = [x for x in losses if math.isfinite(x)]
        z = robust_z(max(finite), list(self.losses)) if finite else None
        self.losses.extend(finite)
        rates = [r["tokens_per_sec"] for r in interval if r["step"] != self.first_step]
        change = None
        if rates:
            now = statistics.median(rates)
            change = throughput_change(now, self.medians)
            self.medians.append(now)
        if change is None and z is None and len(finite) == len(losses):
            return {}  # nothing to judge against yet
        text = verdict(change, z, len(finite) == len(losses))
        return {"health": text, "health_code": CODES[text.split(":")[0]],
                "throughput_change": change, "loss_z": z}

    def forget(self) -> None:
        """A rollback: the steps of the open interval are about to be redone."""
        self.interval = []
