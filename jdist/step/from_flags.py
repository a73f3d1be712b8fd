"""The one place flags become a plan: the model, mesh, rules, optimizer and layout, with
every cross-group check, before anything compiles. The command line (`jdist.train`), the
parallelism planner, the memory tool and the tests all plan through `plan_for`."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from jdist import data
from jdist.config import TrainConfig
from jdist.config.fields import parse_steps
from jdist.config.groups import DEFAULT_PRESET, compute_dtype_name
from jdist.errors import require
from jdist.models import ModelConfig, get_preset
from jdist.models.lora import ATTENTION_TARGETS, TARGETS, LoraConfig
from jdist.parallel import attention as attn
from jdist.parallel import collective_matmul
from jdist.parallel.attention.context import check_context_parallel
from jdist.parallel.moe import overlap_pieces
from jdist.parallel.pipeline import pipeline_for
from jdist.parallel.pipeline import schedule as sched
from jdist.runtime.distributed import mesh_devices
from jdist.runtime.target import overlap_by_default
from jdist.spmd import axes as ax
from jdist.spmd.mesh import build_mesh, parse_mesh
from jdist.spmd.rules import (
    DEFAULT_RULES,
    Rules,
    batch_split,
    load_rules,
    with_sequence_parallel,
)
from jdist.spmd.sharding import check_divisible, check_model_fits, logical_names
from jdist.step.forward import attention_of
from jdist.step.optim import make_optimizer, skip_nonfinite
from jdist.step.state import Compute, Plan, abstract_model, make_plan, with_pipeline

DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16}


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
    last, steps = parse_steps(config.observe.profile_steps)[1], config.optim.steps
    require(last <= steps, f"--profile-steps {config.observe.profile_steps} goes past --steps "
            f"{steps}; profile steps between 1 and {steps} (e.g. --profile-steps "
            f"{min(2, steps)}-{min(3, steps)})")


def model_of(config: TrainConfig) -> ModelConfig:
    """The preset with its shape flags (the vocabulary a `.bin`'s sidecar records unless
    `--vocab-size` is given), or the model a Hugging Face `--init-from` describes; with its
    LoRA adapters when `--lora-rank` is given."""
    path, recorded = config.data.path, data.recorded_vocab(config.data.path)
    if not config.model.init_from:
        model = get_preset(config.model.preset, **{**config.model.overrides(),
                                                   "vocab_size": vocab_of(config, recorded)})
    else:
        from jdist.hf.config import model_config  # reads config.json only

        model = model_config(config.model.init_from)  # first: is it a Hugging Face model?
        require(config.model.preset == DEFAULT_PRESET,
                f"--init-from takes the model from {config.model.init_from}/config.json, not "
                f"from a preset; drop --model {config.model.preset}")
        require(recorded is None or recorded <= model.vocab_size,
                f"--data {path} was tokenized with a vocabulary of {recorded} "
                f"({data.sidecar_path(path)}), more than the {model.vocab_size} of "
                f"--init-from {config.model.init_from}; tokenize it with that model's "
                "tokenizer")
    return with_lora(model, config)


def vocab_of(config: TrainConfig, recorded: int | None) -> int | None:
    """`--vocab-size`, else the vocabulary `recorded` in the data's sidecar (None: the
    preset's). A size given may pad the recorded one (say, to a multiple of tp), never cut
    it."""
    given, path = config.model.vocab_size, config.data.path
    require(given is None or recorded is None or given >= recorded,
            f"--vocab-size {given} is smaller than the vocabulary of {recorded} that "
            f"{data.sidecar_path(path)} records for --data {path}; drop --vocab-size (the "
            f"model then takes {recorded}) or pass {recorded} or more")
    return given if given is not None else recorded


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
    All shape checks happen here, before anything is compiled."""
    config.validate()  # each group's own checks; those across groups follow
    check_profile_steps(config)
    model = model_of(config)
    offload = config.memory.offload
    require(offload != "auto", "--offload auto is chosen by the trainer's fit check "
            "(python -m jdist.train, --dry-run); here give a mode: none, optimizer, params or "
            "disk")
    require(not (config.devices.target and offload not in ("none", "disk")),
            f"--offload {offload} cannot be compiled for --target {config.devices.target}: "
            "jax's "
            "compile-only GPU devices have no host memory space (jax 0.10.2), so the "
            "state would silently stay on the device; drop --target to measure it "
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
    require(not config.parallel.sequence_parallel or mesh.shape[ax.TENSOR] > 1,
            f"--sequence-parallel shards activations over the tensor axis between "
            f"tensor-parallel regions, but --mesh {config.parallel.mesh} has no tp; add tp=T "
            "to --mesh or drop --sequence-parallel")
    require(not (model.n_experts and config.parallel.sequence_parallel
                 and mesh.shape[ax.TENSOR] > 1),
            "--sequence-parallel with tensor parallelism is not supported for MoE models; "
            "drop --sequence-parallel or tp")
    check_streaming(config, model, mesh)
    check_disk(config, model, mesh)
    require(not model.mtp_depth or mesh.shape[ax.STAGE] == mesh.shape[ax.SEQUENCE] == 1,
            "multi-token prediction reads the next token beside each position of the whole "
            "sequence after the last block: not with pp or cp yet; drop them from --mesh or "
            "pass --mtp-depth 0")
    require(not model.kv_lora_rank or config.memory.fp8 == "off",
            "--fp8 is not supported with multi-head latent attention yet (its latent "
            "projections stay in the compute dtype); drop --fp8")
    tx, schedule = optimizer_of(config, model, mesh)
    if config.checkpoint.on_nan == "skip":
        tx = skip_nonfinite(tx)
    plan = make_plan(model, mesh, rules, tx, config.memory, config.parallel, config.finetune)
    return model, with_compute(plan, config), schedule


def check_streaming(config: TrainConfig, model: ModelConfig, mesh) -> None:
    """What `--offload params` (layers streamed from the host, the update on the host:
    `jdist.step.host_update`) cannot run, refused in one line each."""
    if config.memory.offload != "params":
        return
    why = {
        "pipeline chunks of one layer (nothing to stream ahead; give each stage's chunk "
        "two or more)": mesh.shape[ax.STAGE] > 1 and model.n_layers < 2 * mesh.shape[
            ax.STAGE] * config.parallel.pp_virtual_stages,
        "--on-nan skip (its finiteness test is a global norm, which a host computation "
        "cannot take)": config.checkpoint.on_nan == "skip",
        "LoRA (its frozen base needs no host offload)": model.lora is not None,
        "a model of one layer (nothing to stream ahead)": model.n_layers < 2}
    for what, refused in why.items():
        require(not refused, f"--offload params does not run with {what}; use --offload "
                "optimizer, or drop it")


def check_disk(config: TrainConfig, model: ModelConfig, mesh) -> None:
    """What `--offload disk` (moments in files, updated a layer at a time by the host:
    `jdist.step.disk_update`) cannot run, refused in one line each."""
    if config.memory.offload != "disk":
        return
    why = {
        "several processes (each would need its own shards' files)":
            jax.process_count() > 1,
        "a pipeline schedule of several chunks per stage (its layers are stored out of "
        "model order)": mesh.shape[ax.STAGE] > 1 and sched.virtual_stages(
            config.parallel.pp_schedule, config.parallel.pp_virtual_stages) > 1,
        "--on-nan skip (its test wraps the whole-tree update)":
            config.checkpoint.on_nan == "skip",
        "--inject-nan-at-step": bool(config.checkpoint.inject_nan_at_step),
        "LoRA (its frozen base needs no offload)": model.lora is not None}
    for what, refused in why.items():
        require(not refused, f"--offload disk does not run with {what}; use --offload "
                "optimizer, or drop it")


def optimizer_of(config: TrainConfig, model: ModelConfig, mesh=None):
    """(transformation, schedule) from the optimizer flags; Muon reads the parameters'
    logical names to tell matrices from the rest, and lays them out on `mesh`."""
    optim = config.optim
    names = logical_names(abstract_model(model)[1]) if optim.optimizer == "muon" else None
    return make_optimizer(optim.lr, optim.steps, optim.warmup, optim.weight_decay,
                          optim.clip_norm, optimizer=optim.optimizer, schedule=optim.schedule,
                          decay_fraction=optim.decay_fraction, names=names, mesh=mesh,
                          host=config.memory.offload in ("params", "disk"))


def with_compute(plan: Plan, config: TrainConfig) -> Plan:
    """`plan` with the pipeline schedule and the `Compute` the flags ask for: nothing that
    moves state, so the parallelism planner varies these on one plan."""
    pipeline = pipeline_for(config, plan.model, plan.mesh, plan.rules)
    return dataclasses.replace(with_pipeline(plan, pipeline),
                               compute=compute_of(config, plan, pipeline is not None))


def compute_of(config: TrainConfig, plan: Plan, pipelined: bool) -> Compute:
    """How the step computes, from the flags, with every `auto` resolved for this plan's
    mesh and the run's sequence length (dtype, prefetch, collective matmuls, attention),
    and what cannot run refused (cudnn on a CPU, a context-parallel strategy the heads do
    not divide, collective matmuls without sequence parallelism)."""
    memory, seq_len = config.memory, config.data.seq_len
    check_context_parallel(plan.model.n_heads, seq_len, plan.mesh, plan.rules,
                           config.parallel.cp_strategy)
    require(memory.expert_matmul != "kernel" or plan.model.moe_routing == "grouped",
            "--expert-matmul kernel runs grouped routing's expert matmuls; add --moe-routing "
            "grouped, or leave --expert-matmul out")
    # The kernels' own `auto` (prefetch.applies, collective_matmul.applies) reads the same
    # test, so a plan made directly (tests, benchmarks) computes as this one does.
    prefetch = memory.prefetch == "on" or (memory.prefetch == "auto"
                                           and overlap_by_default(plan.mesh))
    matmuls = collective_matmul.applies(memory.collective_matmul, plan.mesh, plan.rules,
                                        pipelined)
    compute = Compute(jnp.dtype(compute_dtype_name(memory, config.finetune)), memory.remat,
                      on_off(prefetch), memory.tp_halves, on_off(matmuls), memory.fp8,
                      memory.grad_accum, memory.attention, memory.loss,
                      config.parallel.cp_strategy, plan.compute.eod_id)
    attention = attention_of(dataclasses.replace(plan, compute=compute), seq_len)
    if memory.attention == attn.CUDNN and attention != attn.CUDNN:  # sinks: flash instead
        print(f"jdist: {attn.SINKS_ON_CUDNN}", file=sys.stderr)
    overlap = overlap_pieces(memory.moe_overlap, plan.mesh) > 1
    return dataclasses.replace(compute, attention=attention, moe_overlap=on_off(overlap),
                               expert_matmul=memory.expert_matmul)


def on_off(value: bool) -> str:
    return "on" if value else "off"
