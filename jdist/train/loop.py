"""The training loop behind `python -m jdist.train`: check everything, plan, initialise,
compile, then step, log and evaluate."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jdist import axes as ax
from jdist import checkpoint as ckpt
from jdist import data, memory, remat
from jdist.distributed import is_main_process
from jdist.errors import require
from jdist.mesh import MeshSpec, build_mesh, parse_mesh
from jdist.parallel.context import check_context_parallel
from jdist.parallel.layer_order import CHECKPOINT_KEY, order_of, restore_order
from jdist.parallel.pipeline import pipeline_for, show_schedule, with_pipeline
from jdist.rules import (
    DEFAULT_RULES,
    Rules,
    load_rules,
    mesh_axes_of,
    resolve,
    with_sequence_parallel,
)
from jdist.sharding import check_divisible, check_model_fits
from jdist.train import faults, report, resume
from jdist.train.config import TrainConfig
from jdist.train.optim import make_optimizer
from jdist.train.state import Plan, TrainState, init_state, make_plan
from jdist.train.step import make_eval_step, make_train_step
from models import ModelConfig, get_preset

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Setup:
    config: TrainConfig
    model: ModelConfig
    corpus: data.Corpus
    plan: Plan
    schedule: object


def mesh_devices(spec: MeshSpec, cpu_fill: int) -> list:
    """The devices a mesh runs on. Simulated CPU devices beyond what it needs are left idle."""
    devices = jax.devices()
    if devices[0].platform == "cpu" and jax.process_count() == 1:
        return devices[: min(len(devices), spec.n_devices(cpu_fill))]
    return devices


def rules_for(config: TrainConfig) -> Rules:
    rules = load_rules(config.rules) if config.rules else DEFAULT_RULES
    return with_sequence_parallel(rules) if config.sequence_parallel else rules


def check_micro_batches(config: TrainConfig, mesh, rules: Rules) -> None:
    """Each micro-batch must still split evenly over the batch-sharding axes."""
    require(config.grad_accum >= 1, f"--grad-accum {config.grad_accum} must be at least 1")
    batch_axes = mesh_axes_of(resolve((ax.BATCH,), rules, mesh)[0])
    ways = math.prod(mesh.shape[a] for a in batch_axes)
    require(config.batch_size % (config.grad_accum * ways) == 0,
            f"--batch-size {config.batch_size} cannot be split into {config.grad_accum} "
            f"micro-batches over {'x'.join(batch_axes)} = {ways} devices; use a multiple of "
            f"{config.grad_accum * ways} or change --grad-accum")


def plan_for(config: TrainConfig) -> tuple[ModelConfig, Plan, object]:
    """Model, mesh, rules, optimizer and layout from the flags: everything except data.
    All shape checks happen here, before anything is compiled (also used by jdist.memory)."""
    model = get_preset(config.model, **config.model_overrides())
    spec = parse_mesh(config.mesh)
    rules = rules_for(config)
    mesh = build_mesh(spec, mesh_devices(spec, config.cpu_devices or 8))
    check_model_fits(model, mesh, rules)
    check_divisible((config.batch_size, config.seq_len), (ax.BATCH, ax.LENGTH), mesh, rules,
                    "global batch")
    check_micro_batches(config, mesh, rules)
    require(not (model.n_experts and config.sequence_parallel and mesh.shape[ax.TENSOR] > 1),
            "--sequence-parallel with tensor parallelism is not supported for MoE models; "
            "drop --sequence-parallel or tp")
    remat.check(config.remat)
    check_context_parallel(model.n_heads, config.seq_len, mesh, rules, config.cp_strategy)
    pipeline = pipeline_for(config, model, mesh)
    tx, schedule = make_optimizer(config.lr, config.steps, config.warmup, config.weight_decay,
                                  config.clip_norm)
    if config.on_nan == "skip":
        tx = faults.skip_nonfinite(tx)
    plan = make_plan(model, mesh, rules, tx, zero=config.zero,
                     offload_optimizer=config.offload == "optimizer",
                     cp_strategy=config.cp_strategy)
    return model, with_pipeline(plan, pipeline), schedule


def prepare(config: TrainConfig) -> Setup:
    """Every check a user's input can fail happens here, before anything is compiled."""
    require(config.steps >= 1, f"--steps {config.steps} must be at least 1")
    require(config.batch_size >= 1, f"--batch-size {config.batch_size} must be at least 1")
    require(config.seq_len >= 2, f"--seq-len {config.seq_len} must be at least 2")
    require(config.eval_batches >= 1 or not config.eval_every,
            f"--eval-batches {config.eval_batches} must be at least 1 (or pass --eval-every 0)")
    faults.check_flags(config)
    model, plan, schedule = plan_for(config)
    require(not (model.shape_only and jax.default_backend() == "cpu"),
            f"model preset {config.model!r} is shape-only on CPU (too large to allocate); "
            "train 'tiny' or 'small' here, or plan it with --dry-run")
    corpus = data.load_corpus(config.data or None, config.seq_len, config.data_dtype)
    data.check_vocab(corpus, model.vocab_size)
    return Setup(config, model, corpus, plan, schedule)


def train(config: TrainConfig) -> list[dict]:
    """Run training; returns the metrics of every step (also written to metrics.jsonl)."""
    if config.pp_show_schedule:
        print(show_schedule(plan_for(config)[1]), flush=True)
        return []
    if config.dry_run:
        memory.dry_run(config)
        return []
    setup = prepare(config)
    memory.check_fits(config, setup.plan)
    plan, corpus, dtype = setup.plan, setup.corpus, DTYPES[config.compute_dtype]
    main = is_main_process()
    run_dir = Path(config.run_dir or report.default_run_dir())
    data_id = data.fingerprint(corpus)
    found = resume.find(config, setup.model, run_dir, data_id)  # before anything is written
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        faults.truncate_metrics(run_dir / "metrics.jsonl", found.step if found else 0)
        (run_dir / "config.json").write_text(json.dumps({
            "train": dataclasses.asdict(config), "model": dataclasses.asdict(setup.model),
            "mesh": dict(plan.mesh.shape), "data": corpus.source,
            "processes": jax.process_count(), "jax": jax.__version__}, indent=2))
        print(report.layout_table(plan), flush=True)
        print(f"data: {corpus.source}: {len(corpus.train):,} train / {len(corpus.val):,} val "
              f"tokens; run dir: {run_dir}", flush=True)

    def batch(step: int, stream: int = data.TRAIN_STREAM):
        return data.global_batch(corpus.train if stream == data.TRAIN_STREAM else corpus.val,
                                 config.seed, step, config.batch_size, config.seq_len,
                                 plan.batch_sharding, stream)

    state = start_state(plan, config.seed, found)
    start = time.perf_counter()
    step_fn = make_train_step(plan, setup.schedule, dtype, config.grad_accum, config.remat)
    if config.inject_nan_at_step:
        step_fn = faults.inject_nan(step_fn, plan, config.inject_nan_at_step)
    step_fn = step_fn.lower(state, batch(0)).compile()
    if main:
        print(f"compiled train step in {time.perf_counter() - start:.1f}s", flush=True)
    eval_fn = make_eval_step(plan, dtype)
    tokens_per_step = config.batch_size * config.seq_len
    progress = report.Progress(config.steps, config.log_every, main)
    log = report.MetricsLog(run_dir if main else None)
    history: list[dict] = []
    last_done = time.perf_counter()
    checkpoints = ckpt.Checkpointer(resume.checkpoint_root(run_dir), config.keep)
    skip_batches: set[int] = set()  # batches passed over after a rollback
    nonfinite = rollbacks = 0

    def evaluate(params) -> dict:
        losses = [eval_fn(params, batch(i, data.VAL_STREAM)) for i in range(config.eval_batches)]
        return {"val_loss": sum(float(x) for x in losses) / len(losses)}

    def finish(step: int, metrics: dict, params=None, passed_over: bool = False) -> None:
        # Normally called one step late, so the host never waits on the step just dispatched.
        nonlocal last_done, nonfinite
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        record = {"step": step, **values, "step_time_s": now - last_done,
                  "tokens_per_sec": tokens_per_step / max(now - last_done, 1e-9)}
        if passed_over:
            record["skipped"] = True
        elif not faults.is_finite(record):
            nonfinite += 1
            if config.on_nan == "rollback":
                raise faults.Rollback(step)
            if config.on_nan == "skip":
                record["skipped"] = True  # the update was not applied (faults.skip_nonfinite)
        record["nonfinite_steps"] = nonfinite
        if params is not None and not record.get("skipped"):
            record.update(evaluate(params))
        last_done = time.perf_counter()  # evaluation time is not training time
        history.append(record)
        log.write(record)
        progress.update(record)
        if config.on_nan == "stop" and not faults.is_finite(record) and not passed_over:
            raise faults.NonFinite(
                f"step {step}: loss {record['loss']} / gradient norm {record['grad_norm']} is "
                "not finite; stopped (--on-nan stop). Lower --lr or raise --warmup, or pass "
                "--on-nan skip or rollback")

    def save(step: int) -> None:
        checkpoints.save(step, state,
                         resume.run_meta(config, setup.model, plan.mesh, step, data_id,
                                         order_of(plan)))

    def steps_from(i: int) -> None:
        # The loop proper. Saves only states whose metrics were checked (flushed) first.
        nonlocal state
        pending = None
        while i < config.steps:
            if i in skip_batches:  # replaying after a rollback: pass over the bad batch
                if pending is not None:  # keep metrics in step order
                    finish(*pending)
                    pending = None
                state = faults.advance(state, plan)
                finish(i + 1, {"loss": float("nan"), "grad_norm": float("nan")},
                       passed_over=True)
                i += 1
                continue
            state, metrics = step_fn(state, batch(i))
            stop_now = stop.poll()
            if pending is not None:
                finish(*pending)
            pending, i = (i + 1, metrics), i + 1
            save_now = bool(config.checkpoint_every) and i % config.checkpoint_every == 0
            eval_now = bool(config.eval_every) and (i % config.eval_every == 0
                                                    or i == config.steps)
            if save_now or stop_now or eval_now:
                finish(*pending, params=state.params if eval_now else None)
                pending = None
            if save_now or stop_now:
                save(i)
            if stop_now:
                checkpoints.wait()
                raise faults.Preempted(i, stop.received)
        if pending is not None:
            finish(*pending)

    def roll_back(bad_step: int) -> int:
        # Restore the newest good checkpoint (or the initial state) and skip the bad batch.
        nonlocal state, rollbacks, log
        rollbacks += 1
        if rollbacks > faults.MAX_ROLLBACKS:
            raise faults.NonFinite(f"step {bad_step}: loss not finite after {rollbacks - 1} "
                                   "rollbacks; giving up (--on-nan rollback)")
        checkpoints.close()
        state = None
        good = resume.find(dataclasses.replace(config, resume="auto"), setup.model, run_dir,
                           data_id)
        state = start_state(plan, config.seed, good)
        first = good.step if good else 0
        skip_batches.add(bad_step - 1)
        print(f"jdist: step {bad_step}: non-finite loss; rolled back to step {first} and will "
              f"skip batch {bad_step}", file=sys.stderr, flush=True)
        history[:] = [r for r in history if r["step"] <= first]
        log.close()
        if main:
            faults.truncate_metrics(run_dir / "metrics.jsonl", first)
        log = report.MetricsLog(run_dir if main else None)
        return first

    i = found.step if found else 0
    try:
        with faults.StopSignal(plan.mesh) as stop:
            while True:
                try:
                    steps_from(i)
                    break
                except faults.Rollback as e:
                    i = roll_back(e.step)
            if config.checkpoint_every and history:
                save(config.steps)  # the final state (skipped if just saved)
    finally:
        checkpoints.close()
        log.close()
    return history


def start_state(plan: Plan, seed: int, found: ckpt.Found | None) -> TrainState:
    """The initial state, or the state restored from `found` laid out for this plan's mesh
    (and its stored layer order)."""
    if found is None:
        return init_state(plan, seed)
    tree, _ = ckpt.restore(found.path, plan.abstract, plan.shardings)
    return restore_order(plan, TrainState(**tree), found.meta.get(CHECKPOINT_KEY))
