"""Everything decided before a training run starts: the flags checked, the model, mesh,
rules, optimizer and layout planned, the data loaded. Nothing here compiles."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jdist import axes as ax
from jdist import data, packing
from jdist.config import TrainConfig
from jdist.config.groups import compute_dtype_name
from jdist.data import sft
from jdist.data.tokenizer import load_tokenizer
from jdist.distributed import mesh_devices
from jdist.errors import require
from jdist.mesh import build_mesh, parse_mesh
from jdist.models import ModelConfig, get_preset
from jdist.models.lora import ATTENTION_TARGETS, TARGETS, LoraConfig
from jdist.parallel import collective_matmul
from jdist.parallel.context import check_context_parallel
from jdist.parallel.pipeline import pipeline_for
from jdist.rules import (
    DEFAULT_RULES,
    Rules,
    batch_split,
    load_rules,
    with_sequence_parallel,
)
from jdist.sharding import check_divisible, check_model_fits
from jdist.step.forward import attention_of
from jdist.step.optim import make_optimizer
from jdist.step.state import Plan, make_plan, with_pipeline
from jdist.train import faults

DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Setup:
    """What `prepare` decided: the run's flags, model, data, layout and learning-rate schedule."""

    config: TrainConfig
    model: ModelConfig
    corpus: data.Corpus
    plan: Plan
    schedule: object
    rows: sft.SftData | None = None  # --data-format sft (then `corpus` holds their tokens)

    def batch(self, step: int, stream: int = data.TRAIN_STREAM) -> dict:
        """The global batch of `step` (training or validation stream), laid out for the mesh."""
        flags = self.config.data
        if self.rows is not None:
            rows = self.rows.train if stream == data.TRAIN_STREAM else self.rows.val
            return sft.sft_batch(rows, flags.seed, step, flags.batch_size,
                                 self.plan.batch_sharding, stream)
        tokens = self.corpus.train if stream == data.TRAIN_STREAM else self.corpus.val
        return data.global_batch(tokens, flags.seed, step, flags.batch_size, flags.seq_len,
                                 self.plan.batch_sharding, stream)


def compute_dtype_of(config: TrainConfig):
    """`--compute-dtype`, with `auto` resolved (`jdist.config.groups.compute_dtype_name`)."""
    return DTYPES[compute_dtype_name(config.memory, config.finetune)]


def rules_for(config: TrainConfig) -> Rules:
    rules = load_rules(config.parallel.rules) if config.parallel.rules else DEFAULT_RULES
    return with_sequence_parallel(rules) if config.parallel.sequence_parallel else rules


def check_micro_batches(config: TrainConfig, mesh, rules: Rules) -> None:
    """Each micro-batch must still split evenly over the batch-sharding axes."""
    batch_axes, ways = batch_split(mesh.shape, rules)
    accum, batch_size = config.memory.grad_accum, config.data.batch_size
    require(batch_size % (accum * ways) == 0,
            f"--batch-size {batch_size} cannot be split into {accum} micro-batches over "
            f"{'x'.join(batch_axes)} = {ways} devices; use a multiple of {accum * ways} or "
            "change --grad-accum")


def check_profile_steps(config: TrainConfig) -> None:
    """`--profile-steps` must name steps the run takes: a trace of steps past the end would
    never start, and the run would say nothing."""
    if not config.observe.profile_steps:
        return
    from jdist.profile import parse_steps

    last, steps = parse_steps(config.observe.profile_steps)[1], config.optim.steps
    require(last <= steps, f"--profile-steps {config.observe.profile_steps} goes past --steps "
            f"{steps}; profile steps between 1 and {steps} (e.g. --profile-steps "
            f"{min(2, steps)}-{min(3, steps)})")


def model_of(config: TrainConfig) -> ModelConfig:
    """The preset with its shape flags, or the model a Hugging Face `--init-from` describes;
    with its LoRA adapters when `--lora-rank` is given."""
    if not config.model.init_from:
        model = get_preset(config.model.preset, **config.model.overrides())
    else:
        from jdist.hf import model_config

        model = model_config(config.model.init_from)
    return with_lora(model, config)


def with_lora(model: ModelConfig, config: TrainConfig) -> ModelConfig:
    flags = config.finetune
    if flags.lora_rank is None:
        return model
    targets = tuple(t.strip() for t in flags.lora_targets.split(",")) if \
        flags.lora_targets else (ATTENTION_TARGETS if model.n_experts else tuple(TARGETS))
    model = dataclasses.replace(model, lora=LoraConfig(flags.lora_rank, flags.lora_alpha,
                                                       targets))
    model.validate()
    return model


def plan_for(config: TrainConfig) -> tuple[ModelConfig, Plan, object]:
    """Model, mesh, rules, optimizer and layout from the flags: everything except data.
    All shape checks happen here, before anything is compiled (also used by jdist.memory)."""
    config.validate()  # each group's own checks; those across groups follow
    check_profile_steps(config)
    model = model_of(config)
    require(not (config.devices.target and config.memory.offload == "optimizer"),
            f"--offload optimizer cannot be compiled for --target {config.devices.target}: "
            "jax's "
            "compile-only GPU devices have no host memory space (jax 0.10.2), so the "
            "optimizer state would silently stay on the device; drop --target to measure it "
            "on the CPU compiler, or drop --offload")
    spec = parse_mesh(config.parallel.mesh)
    rules = rules_for(config)
    devices = config.devices
    mesh = build_mesh(spec, mesh_devices(spec, devices.cpu_devices or 8, devices.target,
                                          devices.hosts))
    check_model_fits(model, mesh, rules)
    check_divisible((config.data.batch_size, config.data.seq_len), (ax.BATCH, ax.LENGTH), mesh,
                    rules, "global batch")
    check_micro_batches(config, mesh, rules)
    require(not (model.n_experts and config.parallel.sequence_parallel
                 and mesh.shape[ax.TENSOR] > 1),
            "--sequence-parallel with tensor parallelism is not supported for MoE models; "
            "drop --sequence-parallel or tp")
    optim = config.optim
    tx, schedule = make_optimizer(optim.lr, optim.steps, optim.warmup, optim.weight_decay,
                                  optim.clip_norm)
    if config.checkpoint.on_nan == "skip":
        tx = faults.skip_nonfinite(tx)
    plan = make_plan(model, mesh, rules, tx, config.memory, config.parallel, config.finetune)
    return model, with_schedule(plan, config), schedule


def with_schedule(plan: Plan, config: TrainConfig) -> Plan:
    """`plan` running the step as `config` says where that moves no state: context-parallel
    strategy, pipeline schedule, attention kernel, remat, accumulation — checked. (The
    parallelism planner varies these on one plan.)"""
    check_context_parallel(plan.model.n_heads, config.data.seq_len, plan.mesh, plan.rules,
                           config.parallel.cp_strategy)
    pipeline = pipeline_for(config, plan.model, plan.mesh, plan.rules)
    plan = dataclasses.replace(plan, cp_strategy=config.parallel.cp_strategy,
                               remat=config.memory.remat, grad_accum=config.memory.grad_accum,
                               prefetch=config.memory.prefetch,
                               tp_halves=config.memory.tp_halves,
                               collective_matmul=config.memory.collective_matmul,
                               attention=config.memory.attention)
    attention_of(plan, config.data.seq_len)  # refuses what cannot run (cudnn on CPU, ...)
    collective_matmul.applies(plan.collective_matmul, plan.mesh, plan.rules,
                              pipeline is not None)
    return with_pipeline(plan, pipeline)


def check_tensor_files(hf_dir: str) -> None:
    """Every safetensors file `--init-from` names is there and opens: a missing shard is
    found before the run directory is written, not when the weights are read."""
    from jdist.hf import Source

    source = Source(hf_dir)
    for name in {file: name for name, file in source.weight_map.items()}.values():
        source.tensor(name)  # opens its file (one tensor per file)


def check_run_dir(config: TrainConfig, model: ModelConfig) -> None:
    """Refuse a --run-dir holding another run's records (config.json, metrics.jsonl) and no
    checkpoint, which starting there would overwrite. The same computation may start over
    (say, after a crash before its first save): it recomputes the records it replaces. With
    a checkpoint, resuming decides (`jdist.train.resume.find`)."""
    from jdist import checkpoint as ckpt
    from jdist.config import result_flags

    run_dir = Path(config.checkpoint.run_dir)
    record = run_dir / "config.json"
    if not config.checkpoint.run_dir or not record.is_file() or \
            ckpt.step_dirs(ckpt.checkpoint_root(run_dir)):
        return
    fix = f"choose a new --run-dir, or delete {run_dir} to reuse its name"
    try:
        saved = json.loads(record.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        saved = None
    require(isinstance(saved, dict) and isinstance(saved.get("train"), dict)
            and isinstance(saved.get("model"), dict),
            f"--run-dir {run_dir} holds a config.json that is not a jdist run's, which this "
            f"run would overwrite; {fix}")
    plain = lambda x: json.loads(json.dumps(x))
    for key, value in plain(dataclasses.asdict(model)).items():
        require(saved["model"].get(key) == value,
                f"--run-dir {run_dir} holds the records of another run (a model with "
                f"{key}={saved['model'].get(key)}, this run's has {key}={value}) and no "
                f"checkpoint; starting here would overwrite them; {fix}")
    defaults, current = plain(TrainConfig().flat()), plain(config.flat())
    for key in result_flags():
        was, flag = saved["train"].get(key, defaults[key]), "--" + key.replace("_", "-")
        require(was == current[key],
                f"--run-dir {run_dir} holds the records of another run ({flag} {was}, this "
                f"run has {flag} {current[key]}) and no checkpoint; starting here would "
                f"overwrite them; {fix}")


def prepare(config: TrainConfig) -> Setup:
    """Every check a user's input can fail happens here (`plan_for` validates the flags
    first), before anything is compiled."""
    model, plan, schedule = plan_for(config)
    check_run_dir(config, model)
    if config.model.init_from:
        check_tensor_files(config.model.init_from)
    require(not (model.shape_only and jax.default_backend() == "cpu"),
            f"model preset {config.model.preset!r} is shape-only on CPU (too large to "
            "allocate); "
            "train 'tiny' or 'small' here, or plan it with --dry-run")
    tokenizer = load_tokenizer(config.data.tokenizer)
    require(not config.data.tokenizer or tokenizer.vocab_size <= model.vocab_size,
            f"--tokenizer {config.data.tokenizer} has {tokenizer.vocab_size} tokens but the "
            "model "
            f"vocabulary is {model.vocab_size}; " + (
                "use the tokenizer of that checkpoint" if config.model.init_from else
                f"pass --vocab-size {tokenizer.vocab_size} or larger"))
    # --data-dtype's default defers to a .bin's sidecar; only another value counts as given.
    dtype = None if config.data.data_dtype == "uint16" else config.data.data_dtype
    rows = sft.for_training(config, tokenizer) if config.data.data_format == sft.SFT else None
    corpus = rows.corpus() if rows is not None else \
        data.load_corpus(config.data.path or None, config.data.seq_len, dtype,
                         tokenizer=tokenizer)
    data.check_vocab(corpus, model.vocab_size)
    # sft records are packed documents
    if config.data.packing == packing.DOCUMENTS or rows is not None:
        require(corpus.eod_id is not None,
                "--packing documents needs an end-of-document id, which byte-level data has "
                "not; pass --tokenizer (one with an eos token) or a .bin written by "
                "python -m jdist.data tokenize")
        plan = dataclasses.replace(plan, eod_id=corpus.eod_id)
    return Setup(config, model, corpus, plan, schedule, rows)
