"""The training state and its layout: create parameters and optimizer state directly in
their target shardings (no device or host ever holds the full model)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdist.config.groups import FinetuneFlags, MemoryFlags, ParallelFlags, compute_dtype_name
from jdist.errors import require
from jdist.models import Llama, ModelConfig
from jdist.models.loss import CHUNKED
from jdist.parallel.grad_sync import manual_part
from jdist.parallel.pipeline import shared as stage_shared
from jdist.parallel.pipeline.layer_order import in_model_order, store
from jdist.quant import nf4
from jdist.spmd import axes as ax
from jdist.spmd import sharding as sh
from jdist.spmd.rules import Rules, mesh_axes_of, resolve
from jdist.spmd.zero import GRADIENTS, OPTIMIZER, PARAMETERS, zero_shardings
from jdist.step import trainable
from jdist.step.optim import HostUpdate

# `--offload` modes that move state (`auto` is resolved before a plan: jdist.train.fit).
OPTIMIZER_STATE, PARAMS, DISK = "optimizer", "params", "disk"
HOST = "pinned_host"


def host(shardings):
    """`shardings` in pinned host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


class TrainState(NamedTuple):
    step: jax.Array
    params: dict  # pure nested dict of float32 arrays (the master weights)
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Compute:
    """How the step computes on a layout. Nothing here moves state, so one layout runs any
    of these (the parallelism planner varies them on one plan). `make_plan` takes them from
    the flag groups as given; `jdist.step.from_flags.compute_of` resolves every `auto`."""

    dtype: Any = jnp.float32       # matmuls and activations; master weights and their
    # gradients and reductions stay float32
    remat: str = "none"            # activation checkpointing (jdist.models.remat)
    prefetch: str = "auto"         # gather layer i+1 while layer i computes (parallel.prefetch)
    tp_halves: bool = False        # each layer on two halves of the rows (parallel.halves)
    collective_matmul: str = "auto"  # SP's collectives as transfers beside matmuls
    fp8: str = "off"               # the block projections in FP8 (jdist.quant.fp8)
    grad_accum: int = 1            # micro-batches scanned per step
    attention: str = "auto"        # jdist.parallel.attention; resolved per sequence length
    loss: str = CHUNKED            # jdist.models.loss.LOSSES
    cp_strategy: str = "ring"      # attention over a sharded sequence (parallel.attention)
    eod_id: int | None = None      # packed documents split at this id (jdist.data.packing)
    moe_overlap: str = "auto"      # expert exchanges in pieces (parallel.moe.overlap_pieces)
    expert_matmul: str = "auto"    # grouped expert matmuls: loop or kernel (parallel.moe)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What is decided before any array exists: where the state lives (structure, shapes,
    shardings, the stored layer order) and how the step computes on it (`compute`)."""

    model: ModelConfig
    mesh: Any
    rules: Rules
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    names: dict           # logical names of every parameter
    abstract: TrainState  # ShapeDtypeStructs
    shardings: TrainState          # where the state lives between steps
    batch_sharding: Any            # for [batch, length] token arrays
    zero: int = 0                  # ZeRO stage over `data` (see jdist.spmd.zero)
    grad_shardings: Any = None     # reduced gradients (sharded over data from ZeRO-2)
    opt_device_shardings: Any = None  # optimizer state while it is being updated
    # PipelineConfig when the mesh has stages (jdist.parallel.pipeline): it decides the
    # stored layer order, so it belongs to the layout.
    pipeline: Any = None
    quantize: str = "none"         # frozen base storage (QLoRA: "nf4"; jdist.step.trainable)
    double_quant: bool = False
    compute: Compute = Compute()

    def computing(self, **changes) -> Plan:
        """The same layout, computing with `changes` (fields of `Compute`)."""
        return dataclasses.replace(self, compute=dataclasses.replace(self.compute, **changes))

    @property
    def offload(self) -> bool:
        return self.opt_device_shardings != self.shardings.opt_state

    @property
    def streams(self) -> bool:
        """`--offload params`: parameters, gradients and optimizer state live in host
        memory; the layer loop streams each layer in, the update runs on the host."""
        return jax.tree.leaves(self.shardings.params)[0].memory_kind == HOST

    @property
    def grads_stream(self) -> bool:
        """`--offload params` writes each layer's gradient to the host as the backward makes
        it, unless something accumulates them first (pipeline ticks, micro-batches): then
        they accumulate on the device and go to the host once, for the update."""
        return self.streams and self.pipeline is None and self.compute.grad_accum == 1

    @property
    def on_disk(self) -> bool:
        """`--offload disk`: the moments live in files, updated a layer at a time
        (`jdist.step.disk_update`) by the optimizer `HostUpdate` (the clip outside)."""
        return isinstance(self.tx, HostUpdate) and not self.streams

    @property
    def device_shardings(self) -> TrainState:
        """`shardings` with the optimizer state in device memory (as during an update)."""
        return self.shardings._replace(opt_state=self.opt_device_shardings)


def with_pipeline(plan: Plan, config) -> Plan:
    """The plan, pipelined (a `jdist.parallel.pipeline.PipelineConfig`) when its mesh has
    more than one stage."""
    if config is None or plan.mesh.shape[ax.STAGE] == 1:
        return plan
    return dataclasses.replace(plan, pipeline=config)


def build_model(cfg: ModelConfig, seed: int) -> Llama:
    # LoRA adapters draw from their own stream, so base weights do not depend on them.
    lora = jax.random.fold_in(jax.random.key(seed), 0x10A)
    return Llama(cfg, rngs=nnx.Rngs(params=seed, lora=lora))


@functools.lru_cache(maxsize=8)
def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and parameter shapes (nothing allocated). Tracing the model
    is most of a plan's cost, and the parallelism planner plans one model many times."""
    return nnx.split(nnx.eval_shape(lambda: build_model(cfg, 0)))


def make_plan(cfg: ModelConfig, mesh, rules: Rules, tx: optax.GradientTransformation,
              memory: MemoryFlags | None = None, parallel: ParallelFlags | None = None,
              finetune: FinetuneFlags | None = None, eod_id: int | None = None) -> Plan:
    """Shapes and shardings of the whole training state, from the model's logical names,
    the ZeRO stage, and whether optimizer state lives in host memory between steps; and
    how the step computes (dtype, remat policy, micro-batches: `memory`; context-parallel
    strategy: `parallel`; the frozen base's storage: `finetune`); a group not given is at
    its defaults."""
    memory, parallel, finetune = (memory or MemoryFlags(), parallel or ParallelFlags(),
                                  finetune or FinetuneFlags())
    memory.validate()  # tests and benchmarks plan without the command line's checks
    zero, quantize, double_quant = memory.zero, finetune.quantize_base, finetune.double_quant
    compute_dtype = jnp.dtype(compute_dtype_name(memory, finetune))
    graphdef, abstract_vars = abstract_model(cfg)
    require(quantize in trainable.QUANTIZATIONS,
            f"unknown --quantize-base {quantize!r}; use {' or '.join(trainable.QUANTIZATIONS)}")
    require(quantize == "none" or trainable.frozen_base(cfg),
            f"--quantize-base {quantize} quantizes a frozen base, which only LoRA has; add "
            "--lora-rank R")
    names = sh.logical_names(abstract_vars)
    model_params = nnx.to_pure_dict(abstract_vars)
    check_quantizable(model_params, names, mesh, rules, quantize)
    abstract_params = trainable.storage_abstract(cfg, model_params, compute_dtype, quantize,
                                                 double_quant)
    names = trainable.storage_names(names, quantize, double_quant)
    base = sh.param_shardings(abstract_params, names, mesh, rules)
    check_replica_layout(base, abstract_params, mesh)
    sharded = zero_shardings(abstract_params, base, names, mesh)
    # Pipelined, the embedding and head are split over stages too (after ZeRO's split).
    stage_dims = stage_shared.split_dims(abstract_params, sharded, names, mesh)
    base, sharded = (stage_shared.over_stages(t, stage_dims) for t in (base, sharded))
    pick = lambda stage: sharded if zero >= stage else base
    # Gradients and optimizer state exist for the trained parameters only.
    trained = trainable.select(cfg, abstract_params)
    opt_device = sh.optimizer_shardings(tx, trained, trainable.select(cfg, pick(OPTIMIZER)),
                                        mesh)
    streams = memory.offload == PARAMS
    require((memory.offload in (PARAMS, DISK)) == isinstance(tx, HostUpdate),
            f"--offload {memory.offload}: plan with the optimizer "
            "jdist.step.from_flags.optimizer_of makes for it")
    opt_rest = host(opt_device) if memory.offload in (OPTIMIZER_STATE, PARAMS) else opt_device
    params_sh, grads_sh = pick(PARAMETERS), trainable.select(cfg, pick(GRADIENTS))
    if streams:
        params_sh, grads_sh = host(params_sh), host(grads_sh)
    state_sh = TrainState(step=sh.replicated(mesh), params=params_sh, opt_state=opt_rest)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                          opt_state=jax.eval_shape(tx.init, trained))
    batch_sharding = jax.sharding.NamedSharding(mesh, resolve((ax.BATCH, ax.LENGTH), rules, mesh))
    compute = Compute(compute_dtype, memory.remat, memory.prefetch, memory.tp_halves,
                      memory.collective_matmul, memory.fp8, memory.grad_accum,
                      memory.attention, memory.loss, parallel.cp_strategy, eod_id,
                      memory.moe_overlap, memory.expert_matmul)
    return Plan(cfg, mesh, rules, tx, graphdef, names, abstract, state_sh, batch_sharding,
                zero, grads_sh, opt_device, quantize=quantize,
                double_quant=double_quant, compute=compute)


# What sets each quantized weight's last dimension (its logical name), in flags.
SHAPE_OF = {ax.HEAD_DIM: "head dimension (--d-model / --n-heads)", ax.EMBED: "--d-model",
            ax.MLP: "--d-ff"}


def check_quantizable(abstract: dict, names: dict, mesh, rules: Rules, quantize: str) -> None:
    """NF4 blocks run along a weight's last dimension (`jdist.quant.nf4`): every shard of it, on
    any mesh axis the rules split it over, must hold whole blocks of 64, so no block
    straddles a shard boundary and the codes are the same on every mesh."""
    def one(path, leaf, leaf_names):
        if not trainable.quantized(path, quantize):
            return
        part = resolve(leaf_names, rules, mesh)[len(leaf_names) - 1] if leaf_names else None
        axes = tuple(a for a in mesh_axes_of(part) if mesh.shape[a] > 1)
        ways = math.prod(mesh.shape[a] for a in axes)
        n, last = leaf.shape[-1], leaf_names[-1] if leaf_names else None
        # A dimension that is not whole blocks fails on every mesh: name the model's shape.
        require(n % nf4.BLOCK == 0,
                f"--quantize-base nf4: parameter {sh.path_str(path)}'s last dimension "
                f"({last}) of {n} weights is not a whole number of NF4 blocks of "
                f"{nf4.BLOCK} on any mesh; QLoRA needs a model whose "
                f"{SHAPE_OF.get(last, 'dimension')} is a multiple of {nf4.BLOCK}")
        require(n % (ways * nf4.BLOCK) == 0,
                f"--quantize-base nf4: parameter {sh.path_str(path)}'s last dimension {n} "
                f"split over {'x'.join(axes)}={ways} gives shards of "
                f"{n / ways:g} weights, not a whole number of NF4 blocks of {nf4.BLOCK}; use a "
                f"smaller {'/'.join(axes)} axis or a model whose dimension is a "
                f"multiple of {ways * nf4.BLOCK}")
    jax.tree_util.tree_map_with_path(one, abstract, names,
                                     is_leaf=lambda x: isinstance(x, tuple))


def check_replica_layout(shardings: dict, abstract: dict, mesh) -> None:
    """The step's shard_map is manual over the replica axes, which must lead each
    dimension's sharding: a one-line error naming the rule, before anything compiles."""
    def one(path, leaf, sharding):
        manual_part(sharding.spec, leaf.ndim, ax.REPLICA_AXES,
                    f"parameter {sh.path_str(path)}")
    jax.tree_util.tree_map_with_path(one, abstract, shardings)


def init_adapters(plan: Plan, seed: int) -> dict:
    """LoRA adapters alone as the seed initialises them (the base's initialisation is dead
    code XLA drops), laid out as the plan stores them: a pruned tree ({} without LoRA)."""
    if not trainable.frozen_base(plan.model):
        return {}
    shardings = trainable.checkpointed(plan.model, plan.shardings.params, save_base=False)

    def init() -> dict:
        params = nnx.to_pure_dict(nnx.state(build_model(plan.model, seed)))
        return trainable.checkpointed(plan.model, params, save_base=False)
    return store(plan, jax.jit(init, out_shardings=shardings)(), shardings)


def state_from_params(plan: Plan, params: dict) -> TrainState:
    """Step 0 from given parameters (already laid out as `plan.shardings.params`, in the
    stored layer order): the optimizer state is initialised next to them."""
    opt = jax.jit(lambda p: plan.tx.init(trainable.select(plan.model, p)),
                  out_shardings=plan.shardings.opt_state)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), plan.shardings.step), params, opt)


def initial(plan: Plan, seed: int) -> TrainState:
    """The initial state in model layer order (to be traced inside `jit`)."""
    params = nnx.to_pure_dict(nnx.state(build_model(plan.model, seed)))
    params = trainable.to_storage(plan.model, params, plan.compute.dtype, plan.quantize,
                                  plan.double_quant)
    return TrainState(jnp.zeros((), jnp.int32), params,
                      plan.tx.init(trainable.select(plan.model, params)))


def init_params(plan: Plan, seed: int) -> dict:
    """`init_state`'s parameters alone, for a plan in model layer order: XLA drops the
    optimizer's initialisation (`--offload disk` makes it a layer at a time)."""
    assert in_model_order(plan)
    return jax.jit(lambda: initial(plan, seed).params, out_shardings=plan.shardings.params)()


def init_state(plan: Plan, seed: int) -> TrainState:
    """Initialise inside `jit` with output shardings: each device computes only its shards;
    then layers move into the plan's stored order (`jdist.parallel.pipeline.layer_order`)."""
    init = functools.partial(initial, plan, seed)
    if in_model_order(plan):
        return jax.jit(init, out_shardings=plan.shardings)()
    on_device = plan.device_shardings
    state = store(plan, jax.jit(init, out_shardings=on_device)(), on_device)
    return jax.device_put(state, plan.shardings) if plan.offload else state
