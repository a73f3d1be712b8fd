"""One training run in progress: its state, its metrics records and its checkpoints, and the
rules of stepping. A step's metrics are read one step late, so the host never waits on the
step it just dispatched, but always before a save, an evaluation or a stop: only states
whose metrics were checked are saved. `--on-nan` decides what a non-finite step does."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax

from jdist import checkpoint as ckpt
from jdist import data
from jdist.config.fields import parse_steps
from jdist.parallel.pipeline.layer_order import order_of
from jdist.step import moment_files
from jdist.step.state import TrainState
from jdist.tools import profile
from jdist.train import faults, goodput, hardware, health, resume, straggler
from jdist.train.goodput import Goodput
from jdist.train.report import StepRecords
from jdist.train.setup import Setup

PASSED_OVER = {"loss": float("nan"), "grad_norm": float("nan")}


def _every(n: int, step: int) -> bool:
    return bool(n) and step % n == 0


@dataclasses.dataclass
class Run:
    """A run from its compiled step on; `train_from(step)` does the training."""

    setup: Setup
    run_dir: Path
    data_id: str  # the data fingerprint, checked on resume
    state: TrainState
    step_fn: Callable  # compiled: (state, batch) -> (state, metrics)
    eval_fn: Callable  # (params, batch) -> loss
    records: StepRecords
    pending: tuple | None = None  # (step, metrics) of the step dispatched but not yet read
    passed_over: set[int] = dataclasses.field(default_factory=set)  # bad batches (rollback)
    nonfinite: int = 0  # steps whose loss or gradient norm was not finite
    rollbacks: int = 0
    stop: Any = None  # the faults.StopSignal, while training
    origin: ckpt.Found | None = None  # the checkpoint the run resumed from (any directory)
    clock: Goodput = dataclasses.field(default_factory=Goodput)
    main: bool = True  # the process that reports

    def __post_init__(self):
        self.config, self.plan = self.setup.config, self.setup.plan
        self.checkpoints = ckpt.Checkpointer(ckpt.checkpoint_root(self.run_dir),
                                             self.config.checkpoint.keep)
        init_from = self.config.model.init_from
        self.hf_source = None
        if init_from:  # read once; each checkpoint records it for jdist.export
            from jdist.hf.config import source_fields
            self.hf_source = source_fields(init_from)
        self.stragglers = None
        if jax.process_count() > 1 and self.config.observe.straggler_every:
            self.stragglers = straggler.Detector(
                self.config.observe.straggler_every, self.config.observe.straggler_threshold,
                self.config.observe.straggler_windows, straggler.hostnames())
        delay = straggler.parse_injection(self.config.observe.inject_straggler)
        self.delay = delay[1] if delay and delay[0] == jax.process_index() else 0.0
        self.delay_from = delay[2] if delay else 1  # the first step that sleeps
        self.waited = 0.0  # seconds blocked on other processes outside reading metrics
        self.tracer, self.held = None, []  # held: records of profiled steps, until read
        if self.config.observe.profile_steps:
            where = self.run_dir / "profile"  # trace files are named after the host:
            if jax.process_count() > 1:      # one directory per process
                where = where / f"process{jax.process_index()}"
            self.tracer = profile.StepTracer(where, *parse_steps(
                self.config.observe.profile_steps))

    def train_from(self, step: int) -> list[dict]:
        """Train from `step` to the end and save the final state; returns every step's
        metrics record."""
        try:
            with faults.StopSignal(self.plan.mesh) as self.stop:
                while True:
                    try:
                        self.steps_from(step)
                        break
                    except faults.Rollback as e:
                        step = self.roll_back(e.step)
                # Every run ends with a checkpoint unless told not to (as torchtitan and
                # MaxText force a save at the last step): generate, export and extending the
                # run all start from it.
                if not self.config.checkpoint.no_final_checkpoint and self.records.history:
                    self.check_replicas(self.config.optim.steps)
                    self.save(self.config.optim.steps)  # skipped if just saved
            with self.clock("checkpoint"):
                self.checkpoints.close()  # raises SaveFailed if the last save did not land
        finally:
            if sys.exc_info()[0] is not None:
                self._close_quietly()
            if self.tracer is not None:
                self.tracer.close()
                self.release_profile(self.held)  # a run stopped inside the profiled steps
            self.records.close()
            self.report_goodput()
        return self.records.history

    def _close_quietly(self) -> None:
        """Closing after an error: the first error is the one reported."""
        try:
            self.checkpoints.close()
        except ckpt.SaveFailed as e:
            print(f"jdist: {e}", file=sys.stderr, flush=True)

    def report_goodput(self) -> None:
        if self.main:
            summary = self.clock.summary()
            goodput.write(self.run_dir, summary)
            print(goodput.table(summary), flush=True)

    def steps_from(self, i: int) -> None:
        while i < self.config.optim.steps:
            if i in self.passed_over:
                with self.clock("train"):
                    self.flush()  # keep the records in step order
                    self.pass_over(i)
            else:
                self.take_step(i)
            i += 1
        with self.clock("train", step=i):
            self.flush()

    def take_step(self, i: int) -> None:
        """Dispatch the step on batch `i`, then read the previous step's metrics."""
        config, done = self.config, i + 1
        with self.clock("data"):
            start = time.perf_counter()
            batch = self.setup.batch(i)
            data_wait = time.perf_counter() - start
        with self.clock("train", step=done):
            if self.delay and done >= self.delay_from:
                time.sleep(self.delay)  # --inject-straggler: this host is slow
            # Dispatch can wait for the previous step (and so for the slowest process), as
            # can agreeing on a stop: neither is this host's own time (`host_time_s`).
            start = time.perf_counter()
            self.state, metrics = self.dispatch(done, batch)
            stop_now = self.stop.poll()
            self.waited += time.perf_counter() - start
            self.flush()
            self.pending = (done, metrics, data_wait)
        save_now = _every(config.checkpoint.checkpoint_every, done)
        eval_every = config.observe.eval_every
        eval_now = _every(eval_every, done) or (bool(eval_every) and done == config.optim.steps)
        if save_now or stop_now or eval_now:
            with self.clock("train", step=done):
                self.flush(params=self.state.params if eval_now else None)
        if save_now or stop_now or _every(config.observe.check_replicas_every, done):
            self.check_replicas(done)  # nothing unchecked is ever saved
        if save_now or stop_now:
            self.save(done)
        if stop_now:
            with self.clock("checkpoint"):
                self.checkpoints.wait()  # raises SaveFailed: no exit 75 without a checkpoint
            raise faults.Preempted(done, self.stop.received)

    def dispatch(self, done: int, batch: dict):
        """The step (twice, compared, on `--recompute-check-every` steps), and the test-only
        corruption after step `--inject-corruption-at-step`."""
        traced = (self.tracer.step(done, pending=self.state) if self.tracer is not None
                  else contextlib.nullcontext())
        with traced:
            if _every(self.config.observe.recompute_check_every, done) and \
                    not self.plan.on_disk:  # its files are rewritten in place: said at compile
                with self.clock("checks"):
                    state, metrics, mismatch = health.recompute_check(self.step_fn, self.state,
                                                                      batch)
                if mismatch is not None:
                    raise faults.Corruption(f"step {done}: {mismatch.message()}")
            else:
                state, metrics = self.step_fn(self.state, batch)
        if done == self.config.observe.inject_corruption_at_step:
            state = state._replace(params=health.inject_corruption(state.params,
                                                                   self.plan.mesh, bit=None))
        return state, metrics

    def check_replicas(self, done: int) -> None:
        """`--check-replicas-every`: every copy of every parameter and optimizer-state shard
        bitwise equal to the others."""
        if not self.config.observe.check_replicas_every:
            return
        with self.clock("checks"):
            mismatch = health.check_replicas(moment_files.on_devices(
                self.state._replace(step=None)), self.plan.mesh)
        if mismatch is not None:
            raise faults.Corruption(f"after step {done}: {mismatch.message()}")

    def pass_over(self, i: int) -> None:
        """Replaying after a rollback: count the step of bad batch `i`, change nothing else."""
        self.state = faults.advance(self.state, self.plan)
        self.finish(i + 1, PASSED_OVER, passed_over=True)

    def flush(self, params=None) -> None:
        """Read and record the pending step's metrics (and evaluate `params` after it)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.finish(*pending, params=params)

    def finish(self, step: int, metrics: dict, data_wait: float = 0.0, params=None,
               passed_over: bool = False) -> None:
        record = self.records.new(step, metrics, data_wait, self.waited)
        self.waited = 0.0
        if self.stragglers is not None and not passed_over:
            start = time.perf_counter()
            reports = self.stragglers.add(record["host_time_s"])
            self.waited += time.perf_counter() - start  # an exchange: waits for the slowest
            straggler.say(self.stragglers, reports, self.main)
            if reports:
                record["stragglers"] = [r["process"] for r in reports]
        record["goodput"] = self.clock.fraction()
        if passed_over:
            record["skipped"] = True
        elif not faults.is_finite(record):
            self.nonfinite += 1
            if self.config.checkpoint.on_nan == "rollback":
                raise faults.Rollback(step)
            if self.config.checkpoint.on_nan == "skip":
                record["skipped"] = True  # the update was not applied (step.optim.skip_nonfinite)
        record["nonfinite_steps"] = self.nonfinite
        if params is not None and not record.get("skipped"):
            record.update(self.evaluate(params))
        self.keep(record)
        if self.config.checkpoint.on_nan == "stop" and not passed_over and \
                not faults.is_finite(record):
            raise faults.stopped(record)

    def keep(self, record: dict) -> None:
        """Keep `record`; a profiled step's waits for the trace to be read (its last one)."""
        if self.tracer is None or not self.tracer.first <= record["step"] <= self.tracer.last:
            self.records.keep(record)
            return
        self.held.append(record)
        if record["step"] == self.tracer.last:
            self.release_profile(self.held, pending=self.state)

    def release_profile(self, held: list[dict], pending=None) -> None:
        """Add each held record's collective/compute/idle fractions from the trace (once it
        is stopped and read), then keep them."""
        if not held:
            return
        with self.clock("profile"):
            try:
                read = {r["step"]: r for r in self.tracer.finish(pending)}
            except profile.TraceError as e:
                print(f"jdist: --profile-steps: the trace could not be read: {e}",
                      file=sys.stderr, flush=True)
                read = {}
        for record in held:
            record.update({k: v for k, v in read.get(record["step"], {}).items()
                           if k.endswith("_fraction")})
        line = hardware.profile_line(held, str(self.tracer.directory))
        if line and self.main:
            print(line, flush=True)
        for record in held:
            self.records.keep(record)
        held.clear()

    def evaluate(self, params) -> dict:
        with self.clock("eval"):
            return self._evaluate(params)

    def _evaluate(self, params) -> dict:
        losses = [self.eval_fn(params, self.setup.batch(i, data.VAL_STREAM))
                  for i in range(self.config.observe.eval_batches)]
        return {"val_loss": sum(float(x) for x in losses) / len(losses)}

    def save(self, step: int) -> None:
        save_base = self.config.finetune.save_base
        state = resume.saved_state(self.plan, self.state, save_base)
        meta = resume.run_meta(self.config, self.setup.model, self.plan.mesh, step, self.data_id,
                               order_of(self.plan), self.hf_source)
        with self.clock("checkpoint"):
            self.checkpoints.save(step, moment_files.as_arrays(state),
                                  {**meta, resume.BASE_SAVED: state is self.state})
            if self.plan.on_disk:  # Orbax reads the files until the save is committed
                self.checkpoints.wait()

    def roll_back(self, bad_step: int) -> int:
        """Restore the newest good checkpoint (or the initial state) and from now on pass over
        the batch of `bad_step`; returns the step restored."""
        self.rollbacks += 1
        if self.rollbacks > faults.MAX_ROLLBACKS:
            raise faults.NonFinite(f"step {bad_step}: loss not finite after "
                                   f"{self.rollbacks - 1} rollbacks; giving up (--on-nan rollback)")
        with self.clock("checkpoint"):
            self.checkpoints.close()
        self.state = self.pending = None  # free the devices before restoring
        good = resume.find(self.config.replace(resume="auto"), self.setup.model,
                           self.run_dir, self.data_id)
        origin = self.origin
        if origin is not None and (good is None or origin.step > good.step) \
                and ckpt.validate(origin.path, self.config.checkpoint.verify_checkpoint
                                  == "full") is None:
            good = origin  # resumed from elsewhere; nothing as recent saved here yet
        with self.clock("checkpoint" if good else "init"):
            self.state = resume.start_state(self.plan, self.config.data.seed, good,
                                             self.config.model.init_from,
                                             moment_files.directory(
                                                 self.config.memory.offload_dir, self.run_dir))
        first = good.step if good else 0
        self.clock.redo_after(first)
        self.passed_over.add(bad_step - 1)
        print(f"jdist: step {bad_step}: non-finite loss; rolled back to step {first} and will "
              f"skip batch {bad_step}", file=sys.stderr, flush=True)
        self.records.forget_after(first)
        self.held[:] = [r for r in self.held if r["step"] <= first]
        return first
