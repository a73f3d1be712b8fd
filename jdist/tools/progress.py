"""What a long command is doing, on stderr: planning a 70B, compiling it for a GPU target or
verifying the planner's best layouts takes minutes, and stdout stays the result's (a table,
one JSON object).

A phase is a line when it starts and one with its seconds when it ends. A counted phase (n
of m meshes searched, layouts compiled) is one updating line on a terminal (tqdm), and in a
log a line every `every` seconds. Each line starts `jdist: `; errors start `jdist: error: `.
"""

from __future__ import annotations

import contextlib
import sys
import time


def say(text: str) -> None:
    print(f"jdist: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def phase(doing: str, done: str = ""):
    """`jdist: {doing} ...` now, and `jdist: {done or doing}: N s` when the block ends (not when
    it raises: the error says why)."""
    say(f"{doing} ...")
    start = time.perf_counter()
    yield
    say(f"{done or doing}: {time.perf_counter() - start:.1f} s")


class Counter:
    """`at(n, m, note)`: n of m done. Used as a context manager around the loop."""

    def __init__(self, doing: str, every: float = 10.0):
        self.doing, self.every = doing, every
        self.start = self.last = time.perf_counter()
        self.bar = None

    def __enter__(self) -> Counter:
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=f"jdist: {self.doing}", file=sys.stderr, leave=False)
        else:
            say(f"{self.doing} ...")
        return self

    def at(self, n: int, total: int, note: str = "") -> None:
        if self.bar is not None:
            self.bar.total, self.bar.n = total, n
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.refresh()
            return
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            say(f"{self.doing}: {n} of {total}{', ' + note if note else ''} "
                f"({now - self.start:.0f} s)")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
        if exc[0] is None:
            say(f"{self.doing}: done in {time.perf_counter() - self.start:.1f} s")
