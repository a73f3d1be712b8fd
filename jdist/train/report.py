"""What a run tells its user: the run directory's config.json, the start-up layout table, the
progress line, each step's metrics record and metrics.jsonl."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax

from jdist.files import write_atomically
from jdist.spmd import sharding as sh
from jdist.spmd.mesh import describe
from jdist.step import moment_files
from jdist.step.forward import attention_of
from jdist.step.state import Plan
from jdist.tools.throughput import flops_per_token, peak_tflops, utilisation
from jdist.train import hardware, slowdown


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
    state = f"optimizer state {_mb(opt)}" + (" (host memory)" if plan.offload else "")
    if plan.on_disk:
        state = (f"optimizer state in files {_mb(moment_files.file_bytes(plan.abstract.opt_state))}"
                 " (one copy; a layer's on the devices during the update)")
    lines.append(f"per-device bytes: parameters {_mb(params)}, {state}")
    return "\n".join(lines)


def compute_line(plan: Plan, config) -> str:
    """Which kernels the step runs: the attention implementation (auto resolved) and loss."""
    return (f"attention: {attention_of(plan, config.data.seq_len)} "
            f"(--attention {config.memory.attention}); "
            f"loss: {plan.compute.loss}; compute dtype: {plan.compute.dtype.name}; "
            f"remat: {plan.compute.remat}")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Training progress on stdout, where `> train.log` keeps it with the layout and the
    summary (errors and warnings go to stderr). One style on a terminal and in a file: step,
    loss, lr, step time, tokens/s, MFU when the peak is known, the busiest device's memory
    in use/peak (n/a where the backend reports none) and the ETA. A terminal gets
    the line rewritten in place every step; anything else a line every `every` steps, at
    evaluations and at the end."""

    WINDOW = 20  # the ETA is the remaining steps at the mean time of the last 20

    def __init__(self, total: int, every: int, enabled: bool):
        self.total, self.every, self.enabled = total, max(1, every), enabled
        self.tty = enabled and sys.stdout.isatty()
        self.times: list[float] = []

    def line(self, m: dict) -> str:
        """The progress text of record `m`."""
        # A process's first step pays one-off costs (first dispatch, allocation): it is left
        # out of the ETA as soon as a second step is known.
        self.times = (self.times + [m["step_time_s"]])[-self.WINDOW - 1:]
        recent = self.times[1:] if len(self.times) > 1 else self.times
        step_s = sum(recent) / len(recent)
        parts = [f"step {m['step']}/{self.total}", f"loss {m['loss']:.4f}"]
        if "lr" in m:
            parts.append(f"lr {m['lr']:.2e}")
        parts += [f"{m['step_time_s']:.3f} s/step", f"{m['tokens_per_sec']:,.0f} tok/s"]
        if "mfu" in m:
            parts.append(f"mfu {m['mfu']:.1%}")
        parts.append(hardware.memory_text(m))
        if "val_loss" in m:
            parts.append(f"val {m['val_loss']:.4f}")
        parts.append(f"eta {_clock(step_s * (self.total - m['step']))}")
        return " | ".join(parts)

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        text = self.line(m)
        if self.tty:
            end = "\n" if m["step"] == self.total or "val_loss" in m else ""
            print("\r\033[K" + text, end=end, file=sys.stdout, flush=True)
        elif m["step"] % self.every == 0 or m["step"] == self.total or "val_loss" in m:
            print(text, file=sys.stdout, flush=True)


class MetricsLog:
    """`RUN_DIR/metrics.jsonl`: one JSON object per step, flushed as written. Opening it
    drops the records after `resume_step` (they are about to be redone; `dropped_s` is the
    step time they took). `None`: no file (processes other than the first)."""

    def __init__(self, run_dir: Path | None, resume_step: int = 0):
        self.path = run_dir / "metrics.jsonl" if run_dir else None
        self.file = None
        self.dropped_s = 0.0
        self.truncate(resume_step)

    def truncate(self, last_step: int) -> None:
        """Drop the records after `last_step`, then go on appending."""
        if self.path is None:
            return
        self.close()
        if self.path.exists():
            records = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
            kept = [r for r in records if r.get("step", 0) <= last_step]
            self.dropped_s += sum(r.get("step_time_s", 0.0) for r in records
                                  if r.get("step", 0) > last_step)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.file = self.path.open("a")

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None


class StepRecords:
    """Every step's metrics record: timed from when the previous one was kept (so evaluation
    is not training time), kept in `history`, written to metrics.jsonl (and the other
    `sinks`), shown as progress. `host_time_s` is the step's time less the time the host
    blocked waiting for the devices' results (what tells a straggling host apart)."""

    def __init__(self, config, log: MetricsLog, show: bool, plan=None, sinks=()):
        self.tokens_per_step = config.data.batch_size * config.data.seq_len
        self.flops = flops_per_token(plan.model, config.data.seq_len) if plan else 0.0
        self.devices = plan.mesh.size if plan else 1
        self.peak = peak_tflops(plan.mesh.devices.flat[0].device_kind,
                                config.observe.peak_tflops) if plan else 0.0
        self.attention = attention_of(plan, config.data.seq_len) if plan else None
        self.progress = Progress(config.optim.steps, config.observe.log_every, show)
        self.log, self.sinks, self.history = log, list(sinks), []
        self.health, self.show = slowdown.Monitor(config.observe.log_every), show
        self.last_done = time.perf_counter()

    def new(self, step: int, metrics: dict, data_wait: float = 0.0, waited: float = 0.0) -> dict:
        """The record of `step` from its metrics (waits for them to be computed);
        `data_wait`: the seconds spent building its batch; `waited`: other seconds the host
        may have blocked on the devices or other processes since the last record (dispatch,
        agreeing on a stop, exchanging step times)."""
        blocked = time.perf_counter()
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        elapsed = now - self.last_done
        tokens_per_sec = self.tokens_per_step / max(elapsed, 1e-9)
        return {"step": step, **values, "step_time_s": elapsed, "tokens_per_sec": tokens_per_sec,
                "host_time_s": max(0.0, elapsed - (now - blocked) - waited),
                "data_wait_s": data_wait,
                **hardware.device_memory(),
                **({"attention": self.attention} if self.attention else {}),
                **(utilisation(tokens_per_sec, self.flops, self.devices, self.peak)
                   if self.flops else {})}

    def keep(self, record: dict) -> None:
        self.last_done = time.perf_counter()
        record.update(self.health.add(record, last=record["step"] == self.progress.total))
        if self.show and record.get("health", "ok") != "ok":
            print(f"jdist: health: step {record['step']}: {record['health']}", file=sys.stderr,
                  flush=True)
        self.history.append(record)
        self.log.write(record)
        for sink in self.sinks:
            sink.write(record)
        self.progress.update(record)

    def forget_after(self, step: int) -> None:
        """Drop the records after `step` (a rollback is about to redo them)."""
        self.history[:] = [r for r in self.history if r["step"] <= step]
        self.log.truncate(step)
        self.health.forget()

    def close(self) -> None:
        self.log.close()
        for sink in self.sinks:
            sink.close()


def open_run_dir(run_dir: Path, setup, resume_step: int) -> MetricsLog:
    """Create RUN_DIR with config.json (every setting), print the layout and the data, and
    return the run's metrics log (records after `resume_step` dropped)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir, resume_step)
    config, plan, corpus = setup.config, setup.plan, setup.corpus
    # Whole or not at all (through a rename): a Ctrl-C or a full disk never leaves a
    # truncated config.json, which the next run in RUN_DIR would refuse as not a jdist run's.
    write_atomically(run_dir / "config.json", json.dumps({
        "train": config.flat(), "model": dataclasses.asdict(setup.model),
        "mesh": dict(plan.mesh.shape), "data": corpus.source,
        "processes": jax.process_count(), "jax": jax.__version__}, indent=2))
    print(layout_table(plan), flush=True)
    print(compute_line(plan, config), flush=True)
    train, val = setup.token_counts()
    print(f"data: {corpus.source}: {train:,} train / {val:,} val "
          f"tokens{'; ' + corpus.note if corpus.note else ''}; run dir: {run_dir}", flush=True)
    return log


def default_run_dir() -> str:
    return time.strftime("runs/%Y%m%d-%H%M%S")
