"""What a run tells its user: the start-up layout table, the progress bar, metrics.jsonl."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax

from jdist import sharding as sh
from jdist.mesh import describe
from jdist.train.state import Plan


def _mb(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def layout_table(plan: Plan) -> str:
    """Mesh, each parameter's logical names -> sharding and per-device shape, state bytes."""
    lines = [f"mesh: {describe(plan.mesh)}",
             f"model: {plan.model.n_params() / 1e6:,.2f}M parameters",
             f"{'parameter':28} {'shape':22} {'logical axes':36} {'sharding':28} per-device"]
    flat = jax.tree_util.tree_flatten_with_path(plan.abstract.params)[0]
    shardings = jax.tree.leaves(plan.shardings.params,
                                is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    names = jax.tree.leaves(plan.names, is_leaf=lambda x: isinstance(x, tuple))
    for (path, leaf), sharding, logical in zip(flat, shardings, names):
        spec = ",".join("-" if p is None else p if isinstance(p, str) else "x".join(p)
                        for p in sharding.spec) or "replicated"
        lines.append(f"{sh.path_str(path):28} {leaf.shape!s:22} {','.join(map(str, logical)):36}"
                     f" {spec:28} {sharding.shard_shape(leaf.shape)}")
    params = sh.per_device_bytes(plan.abstract.params, plan.shardings.params)
    opt = sh.per_device_bytes(plan.abstract.opt_state, plan.shardings.opt_state)
    lines.append(f"per-device bytes: parameters {_mb(params)}, optimizer state {_mb(opt)}")
    return "\n".join(lines)


class Progress:
    """A one-line progress bar on a terminal; a plain line every `every` steps otherwise."""

    def __init__(self, total: int, every: int, enabled: bool):
        self.total, self.every, self.enabled = total, max(1, every), enabled
        self.tty = enabled and sys.stderr.isatty()

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * m["step"] / self.total)
        text = (f"[{'#' * done}{'.' * (width - done)}] step {m['step']}/{self.total} "
                f"loss {m['loss']:.4f} {m['tokens_per_sec']:,.0f} tok/s")
        if "val_loss" in m:
            text += f" val {m['val_loss']:.4f}"
        if self.tty:
            end = "\n" if m["step"] == self.total else ""
            print("\r" + text, end=end, file=sys.stderr, flush=True)
        elif m["step"] % self.every == 0 or m["step"] == self.total or "val_loss" in m:
            print(text, file=sys.stderr, flush=True)


class MetricsLog:
    """`RUN_DIR/metrics.jsonl`: one JSON object per step, flushed as written."""

    def __init__(self, run_dir: Path | None):
        self.file = (run_dir / "metrics.jsonl").open("a") if run_dir else None

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def default_run_dir() -> str:
    return time.strftime("runs/%Y%m%d-%H%M%S")
