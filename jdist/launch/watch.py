"""A group's output as the elastic launcher reads it: checkpoints saved, and hosts the
training processes' health checks flag. The lines are those the training code prints
(`jdist.checkpoint`, `jdist.train.straggler`, `jdist.train.health`: a layer above, so
matched here as text; tests/test_elastic.py runs the real ones)."""

from __future__ import annotations

import re
import threading

SAVED = "checkpoint: saved step "
# A process the health checks single out: a straggler, or the odd replica a majority of
# replicas outvotes (without a majority nobody can say which copy is wrong).
FLAGS = {
    "straggling": re.compile(r"straggler: process (\d+) on host"),
    "silent data corruption": re.compile(
        r"silent data corruption: .* differs on replica .*\(process (\d+), "),
}


class Watch:
    """Fed every output line of one group (from its reader threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.saves = 0
        self.flagged: dict[int, str] = {}  # process index -> what its health check found

    def __call__(self, line: str) -> None:
        with self.lock:
            if SAVED in line:
                self.saves += 1
            for what, pattern in FLAGS.items():
                found = pattern.search(line)
                if found:
                    self.flagged.setdefault(int(found.group(1)), what)

    def flag(self, what: str) -> int | None:
        """The first process flagged for `what`, or None."""
        with self.lock:
            return next((p for p, w in self.flagged.items() if w == what), None)
