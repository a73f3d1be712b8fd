"""Goodput: where a run's wall time went. Every stretch of the run is timed into exactly one
category (nested stretches are subtracted from the one around them), so the categories sum
to the wall time up to what no stretch covers (`unaccounted_s`, reported, not hidden).

    setup       flags, data, plan, choosing the checkpoint
    init        the initial state (random or --init-from)
    compile     compiling the step ahead of time
    train       productive steps (dispatch, waiting for the devices, metrics)
    data        building batches on the host
    checkpoint  blocking checkpoint saves, waits for them, restores
    eval        held-out evaluation
    checks      health checks (replica fingerprints, recomputed steps)
    profile     capturing and reading a --profile-steps trace
    lost        steps done and then redone (after a rollback)

Work lost to a resume (steps the previous run did after the checkpoint it resumed from)
happened in another process; it is reported beside this run's wall time, not in it.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from jdist.files import write_atomically

CATEGORIES = ("setup", "init", "compile", "train", "data", "checkpoint", "eval", "checks",
              "profile", "lost")
FILE = "goodput.json"


class Goodput:
    """Wall-time accounting of one run, from its construction to `summary()`."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.step_train: dict[int, float] = {}  # train seconds of each step done
        self.lost_before_resume = 0.0
        self._stack: list[list] = []  # [category, start, seconds of nested stretches]

    @contextlib.contextmanager
    def __call__(self, category: str, step: int | None = None):
        """Time the enclosed stretch as `category` (minus nested stretches); `step` also
        files train time under that step, so a rollback can move it to `lost`."""
        self._stack.append([category, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            _, start, nested = self._stack.pop()
            elapsed = time.perf_counter() - start
            own = elapsed - nested
            self.seconds[category] += own
            if step is not None:
                self.step_train[step] = self.step_train.get(step, 0.0) + own
            if self._stack:
                self._stack[-1][2] += elapsed

    def redo_after(self, step: int) -> None:
        """A rollback to `step`: the train time of every later step becomes lost work."""
        for s in [s for s in self.step_train if s > step]:
            seconds = self.step_train.pop(s)
            self.seconds["train"] -= seconds
            self.seconds["lost"] += seconds

    def fraction(self) -> float:
        """Productive training time over wall time so far."""
        return self.seconds["train"] / max(time.perf_counter() - self.start, 1e-9)

    def summary(self) -> dict:
        wall = time.perf_counter() - self.start
        accounted = sum(self.seconds.values())
        return {"wall_s": wall, **{f"{k}_s": v for k, v in self.seconds.items()},
                "unaccounted_s": wall - accounted, "goodput": self.seconds["train"] / wall,
                "lost_before_resume_s": self.lost_before_resume}


def table(summary: dict) -> str:
    wall = summary["wall_s"]
    parts = [f"{k} {summary[k + '_s']:.1f}s ({summary[k + '_s'] / wall:.0%})"
             for k in CATEGORIES if summary[k + "_s"] >= 0.05]
    line = f"goodput {summary['goodput']:.1%} of {wall:.1f}s: " + ", ".join(parts)
    if summary["lost_before_resume_s"]:
        line += f"; {summary['lost_before_resume_s']:.1f}s of an earlier run redone"
    return line


def write(run_dir: Path, summary: dict) -> None:
    """RUN_DIR/goodput.json: this run's summary, after the earlier runs' (resumes) ones."""
    path = Path(run_dir) / FILE
    runs = json.loads(path.read_text()).get("runs", []) if path.exists() else []
    body = {**summary, "runs": [*runs, summary]}
    write_atomically(path, json.dumps(body, indent=1))
