"""`train(config)`, the entry point behind `python -m jdist.train`: check everything and plan
(`jdist.train.setup`), choose what to resume from, initialise or restore the state, compile
the step, then run it (`jdist.train.run`)."""

from __future__ import annotations

import time
from pathlib import Path

from jdist.errors import require_writable_dir
from jdist.parallel.pipeline import show_schedule
from jdist.runtime.distributed import is_main_process
from jdist.step import moment_files
from jdist.step.build import compiler_options, make_eval_step, make_train_step
from jdist.step.from_flags import model_of, plan_for
from jdist.step.state import TrainState
from jdist.train import fit, report, resume
from jdist.train.goodput import Goodput
from jdist.train.run import Run
from jdist.train.setup import Setup, prepare, with_model_tokenizer
from jdist.train.tensorboard import TensorBoardLog


def train(config) -> list[dict]:
    """Run training; returns the metrics of every step (also written to metrics.jsonl)."""
    config = fit.resolve_offload(config)
    if config.parallel.pp_show_schedule:
        plan = plan_for(config)[1]
        print(show_schedule(plan.pipeline, plan.mesh.shape["stage"]), flush=True)
        return []
    if config.memory.dry_run:
        fit.dry_run(config)
        return []
    clock = Goodput()
    run_dir = Path(config.checkpoint.run_dir or report.default_run_dir())
    config.validate()
    require_writable_dir(run_dir, f"--run-dir {run_dir}")
    config = with_model_tokenizer(config)  # before the flags are compared with a saved run's
    done = resume.finished(config, run_dir, model_of)  # before data, plans or compiles
    if done is not None:
        if is_main_process():
            print(f"jdist: {done}", flush=True)
        return []
    with clock("setup"):
        setup = prepare(config)
        fit.check_fits(config, setup.plan)
        data_id = setup.fingerprint()
        found = resume.find(config, setup.model, run_dir, data_id,  # before anything is written
                            dict(setup.plan.mesh.shape))
        first = found.step if found else 0
        main = is_main_process()
        change = resume.schedule_change(found, config, setup.schedule)
        if change is not None and main:
            print(change, flush=True)
        log = report.open_run_dir(run_dir, setup, first) if main else report.MetricsLog(None)
        clock.lost_before_resume = log.dropped_s
        sinks = [TensorBoardLog(run_dir)] if config.observe.tensorboard and main else []
    with clock("checkpoint" if found else "init"):
        state = resume.start_state(setup.plan, config.data.seed, found, config.model.init_from,
                                   offload_dir(config, run_dir))
    with clock("compile"):
        step_fn = compile_step(setup, state)
        eval_fn = make_eval_step(setup.plan)
    run = Run(setup, run_dir, data_id, state, step_fn, eval_fn,
              report.StepRecords(config, log, main, setup.plan, sinks), origin=found,
              clock=clock, main=main)
    return run.train_from(first)


def offload_dir(config, run_dir: Path) -> Path:
    """Where `--offload disk` keeps the moments' files."""
    return moment_files.directory(config.memory.offload_dir, run_dir)


def compile_step(setup: Setup, state: TrainState):
    """The train step (with `--inject-nan-at-step`, if asked), compiled ahead of time;
    `--offload disk`'s programs compile as its first step runs them (one per layer group,
    `jdist.step.disk_update`)."""
    start = time.perf_counter()
    step_fn = make_train_step(setup.plan, setup.schedule,
                              inject_nan_at_step=setup.config.checkpoint.inject_nan_at_step)
    if setup.plan.on_disk:
        if is_main_process() and setup.config.observe.recompute_check_every:
            print("jdist: --offload disk: no --recompute-check-every (the update rewrites the "
                  "moments' files in place, so a step cannot run twice)", flush=True)
        return step_fn
    # jdist's GPU flags (jdist.runtime.target)
    options = compiler_options(setup.plan)
    step_fn = step_fn.lower(state, setup.batch(0)).compile(options or None)
    if is_main_process():
        print(f"compiled train step in {time.perf_counter() - start:.1f}s", flush=True)
    return step_fn
