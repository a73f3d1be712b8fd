"""The training loop behind `python -m jdist.train`: check everything, plan, initialise,
compile, then step, log and evaluate."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jdist import axes as ax
from jdist import data
from jdist.distributed import is_main_process
from jdist.errors import require
from jdist.mesh import MeshSpec, build_mesh, parse_mesh
from jdist.rules import DEFAULT_RULES, Rules, load_rules, with_sequence_parallel
from jdist.sharding import check_divisible, check_model_fits
from jdist.train import report
from jdist.train.config import TrainConfig
from jdist.train.optim import make_optimizer
from jdist.train.state import Plan, init_state, make_plan
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


def prepare(config: TrainConfig) -> Setup:
    """Every check a user's input can fail happens here, before anything is compiled."""
    require(config.steps >= 1, f"--steps {config.steps} must be at least 1")
    require(config.batch_size >= 1, f"--batch-size {config.batch_size} must be at least 1")
    require(config.seq_len >= 2, f"--seq-len {config.seq_len} must be at least 2")
    model = get_preset(config.model, **config.model_overrides())
    spec = parse_mesh(config.mesh)
    rules = rules_for(config)
    mesh = build_mesh(spec, mesh_devices(spec, config.cpu_devices or 8))
    require(not (model.shape_only and jax.default_backend() == "cpu"),
            f"model preset {config.model!r} is shape-only on CPU (too large to allocate); "
            "train 'tiny' or 'small' here")
    check_model_fits(model, mesh, rules)
    check_divisible((config.batch_size, config.seq_len), (ax.BATCH, ax.LENGTH), mesh, rules,
                    "global batch")
    corpus = data.load_corpus(config.data or None, config.seq_len, config.data_dtype)
    data.check_vocab(corpus, model.vocab_size)
    tx, schedule = make_optimizer(config.lr, config.steps, config.warmup, config.weight_decay,
                                  config.clip_norm)
    return Setup(config, model, corpus, make_plan(model, mesh, rules, tx), schedule)


def train(config: TrainConfig) -> list[dict]:
    """Run training; returns the metrics of every step (also written to metrics.jsonl)."""
    setup = prepare(config)
    plan, corpus, dtype = setup.plan, setup.corpus, DTYPES[config.compute_dtype]
    main = is_main_process()
    run_dir = Path(config.run_dir or report.default_run_dir())
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
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

    state = init_state(plan, config.seed)
    start = time.perf_counter()
    step_fn = make_train_step(plan, setup.schedule, dtype).lower(state, batch(0)).compile()
    if main:
        print(f"compiled train step in {time.perf_counter() - start:.1f}s", flush=True)
    eval_fn = make_eval_step(plan, dtype)
    tokens_per_step = config.batch_size * config.seq_len
    progress = report.Progress(config.steps, config.log_every, main)
    log = report.MetricsLog(run_dir if main else None)
    history: list[dict] = []
    last_done = time.perf_counter()

    def evaluate(params) -> dict:
        losses = [eval_fn(params, batch(i, data.VAL_STREAM)) for i in range(config.eval_batches)]
        return {"val_loss": sum(float(x) for x in losses) / len(losses)}

    def finish(step: int, metrics: dict, params=None) -> None:
        # Normally called one step late, so the host never waits on the step just dispatched.
        nonlocal last_done
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        record = {"step": step, **values, "step_time_s": now - last_done,
                  "tokens_per_sec": tokens_per_step / max(now - last_done, 1e-9)}
        if params is not None:
            record.update(evaluate(params))
        last_done = time.perf_counter()  # evaluation time is not training time
        history.append(record)
        log.write(record)
        progress.update(record)

    pending = None
    for i in range(config.steps):
        state, metrics = step_fn(state, batch(i))
        if pending is not None:
            finish(*pending)
        pending = (i + 1, metrics)
        if config.eval_every and ((i + 1) % config.eval_every == 0 or i + 1 == config.steps):
            finish(*pending, params=state.params)
            pending = None
    if pending is not None:
        finish(*pending)
    log.close()
    return history
