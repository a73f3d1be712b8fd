"""What the benchmark scripts share, once: the repository on the import path (importing this
module puts it there, so a script runs from a checkout without an install), the simulated CPU
devices (set before jax starts its backends), the argument parser with `--json` and the
`--target` of the scripts that also compile for a GPU, the JSON-or-text output, aligned
tables, a plan with a throwaway optimizer, timed steps and the compiled step's temporaries.
Each script keeps its own measurements; nothing here imports jax until it is called."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB, GiB = 2**20, 2**30
TARGETS = "jdist.runtime.target: h100-80gb, h200-141gb, a100-80gb"
GPU_DEFAULT = "default h100-80gb where jax's CUDA plugin is installed"


def setup_devices(n: int = 8, cpu_only: bool = False) -> None:
    """`n` simulated CPU devices, and with `cpu_only` the CPU platform alone (ahead-of-time
    compiles on CPU devices, on any host). Call before jax starts its backends, that is
    before the first use of a device: at the top of a script, before the project's imports."""
    import jax

    from jdist.runtime.distributed import configure_devices

    if cpu_only:
        jax.config.update("jax_platforms", "cpu")
    configure_devices(n)


def make_parser(doc: str) -> argparse.ArgumentParser:
    """The script's parser: the first line of its docstring as description, and `--json`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    return parser


def add_target(parser: argparse.ArgumentParser, what: str = "also compile each step for this GPU",
               default: str = GPU_DEFAULT, none: str = "the CPU only") -> None:
    """`--target NAME|none`, resolved by `requested_target`."""
    parser.add_argument("--target", default=None,
                        help=f"{what} ({TARGETS}; {default}); none: {none}")


def requested_target(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     default: bool = True) -> str:
    """`args.target` checked (`jdist.runtime.target.requested`, which names the script on stderr and
    exits 2 when it cannot be compiled for): '' for none."""
    from jdist.runtime import target

    return target.requested(args.target, parser.prog, default)


def emit(result: Any, as_json: bool, text: Callable[[], Iterable[str]], *,
         indent: int | None = None, default: Callable | None = None) -> None:
    """Print `result` as one JSON document with `as_json`, else the lines of `text()`."""
    if as_json:
        print(json.dumps(result, indent=indent, default=default))
        return
    for line in text():
        print(line)


# [[fill]align][sign][z][#][0][width][,|_][.precision][type] of a spec, or of a template's field
_SPEC = re.compile(r"(?:.?([<>=^]))?[-+ ]?z?#?0?(\d*)[,_]?(?:\.\d+)?([a-zA-Z%]?)$")


@dataclass(frozen=True)
class Column:
    """One column of a `table`: `title` over the values of `get` (a row's key, default the
    title, or a function of the row), divided by `scale`, written with `spec`: a format spec
    (`"10.3f"`, `">7"`) or a template (`"{:8.1f}M"`). The title takes the spec's width
    (`width` where a template adds to it), right-aligned over numbers and left over text
    unless the spec aligns it."""

    title: str
    spec: str = ""
    get: str | Callable[[dict], Any] = ""
    scale: float = 1
    width: int = 0

    def value(self, row: dict) -> str:
        v = self.get(row) if callable(self.get) else row[self.get or self.title]
        if self.scale != 1:
            v = v / self.scale
        return self.spec.format(v) if "{" in self.spec else format(v, self.spec)

    def header(self) -> str:
        field = re.search(r"\{:([^}]*)\}", self.spec)
        align, width, kind = _SPEC.match(field.group(1) if field else self.spec).groups()
        align = align or (">" if kind in tuple("deEfFgGn%") else "<")
        return format(self.title, f"{align}{self.width or width}")


def table(rows: Iterable[dict], columns: Sequence[Column]) -> list[str]:
    """The header line and one line per row, columns one space apart."""
    return [" ".join(c.header() for c in columns)] + \
        [" ".join(c.value(r) for c in columns) for r in rows]


def simple_plan(model, mesh, memory=None, lr: float = 1e-3, steps: int = 10):
    """`make_plan` of `model` on `mesh` with the default rules and AdamW at `lr` over a
    schedule of `steps` (one warmup step)."""
    from jdist.spmd.rules import DEFAULT_RULES
    from jdist.step import make_optimizer, make_plan

    tx, _ = make_optimizer(lr, steps, 1)
    return make_plan(model, mesh, DEFAULT_RULES, tx, *([memory] if memory else []))


def time_steps(step, state, batches: Sequence[dict], steps: int):
    """One warm-up step (compiling if `step` is not yet) on `batches[0]`, then `steps` timed
    steps cycling through `batches`: (state, last metrics, seconds of the timed steps)."""
    import time

    import jax

    state, metrics = step(state, batches[0])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    return state, metrics, time.perf_counter() - start


def temp_bytes(compiled) -> int:
    """Per-device temporaries of a compiled program (`memory_analysis`)."""
    return compiled.memory_analysis().temp_size_in_bytes
