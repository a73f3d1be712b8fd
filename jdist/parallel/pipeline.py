"""Pipeline parallelism over the `stage` axis: an explicit `jax.shard_map` that runs a static
schedule table (`jdist.parallel.schedule`) tick by tick.

Layout. The stacked blocks are split over `stage` by the rule `layers -> stage`; with V
virtual stages (interleaved) the stack is *stored* permuted (`jdist.parallel.layer_order`)
so that stage s's shard is chunks s, s+P, s+2P, ... Embedding, final norm and head are
replicated over `stage`: the first chunk embeds its micro-batch's tokens, the last one
computes the loss, so the loss is the model's own. Their gradients (zero on the stages that
do not use them) are summed over `stage` once per step; block gradients never leave their
stage.

Execution. The kernel is manual over `stage` and `data` (each data replica runs its own
pipeline; `fsdp`, `tensor`, `sequence`, `expert` stay automatic, so GSPMD and the nested MoE
and attention kernels shard each stage's work as usual). Each stage runs the schedule tick
by tick (`jdist.parallel.stage_program`); a backward recomputes its chunk from the stashed
chunk input (`jax.vjp` per micro-batch, as GPipe does), so a stage holds only the inputs of
its in-flight micro-batches: all M of them under gpipe, about P under 1f1b. Per-replica
gradients then go through the same ZeRO reduction as without pipelining
(`jdist.zero.reduce_over_data`). Evaluation runs the forwards of the same schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jdist import axes as ax
from jdist.errors import require
from jdist.parallel import schedule as sched
from jdist.parallel import stage_program
from jdist.parallel.layer_order import BLOCKS
from jdist.parallel.stage_program import CROSS_ENTROPY, OBJECTIVE, loss_terms, moe_metrics
from jdist.zero import reduce_over_data

if TYPE_CHECKING:
    from jdist.train.state import Plan


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: str = sched.ONE_F_ONE_B
    microbatches: int = 0  # 0: one per stage
    virtual: int = 1       # layer chunks per stage (interleaved)

    def table(self, stages: int, forward_only: bool = False) -> sched.Schedule:
        return sched.build(self.schedule, stages, self.microbatches or stages, self.virtual,
                           forward_only)


def check_pipeline(config: PipelineConfig, model, mesh, batch_size: int,
                   grad_accum: int = 1) -> None:
    """User errors of a pipelined run, one line each, before anything compiles."""
    stages = mesh.shape[ax.STAGE]
    micro = config.microbatches or stages
    sched.check(config.schedule, stages, micro, config.virtual, model.n_layers)
    require(grad_accum == 1, f"--grad-accum {grad_accum} with pp={stages}: the pipeline "
                             "already accumulates over --microbatches; use that instead")
    ways = mesh.shape[ax.DATA] * mesh.shape[ax.FSDP] * mesh.shape[ax.EXPERT]
    require(batch_size % (ways * micro) == 0,
            f"--batch-size {batch_size} cannot be split into {micro} micro-batches on each of "
            f"data x fsdp x expert = {ways} batch shards; use a multiple of {ways * micro}")


def pipeline_grads(plan: Plan, params: dict, batch: dict, compute_dtype=jnp.float32,
                   remat_block=lambda f: f):
    """(mean loss, metrics, gradients laid out as `plan.grad_shardings`), like
    `jdist.train.grads.accumulated_grads`, computed by the pipeline schedule."""
    losses, grads = replica_grads(plan, params, batch, compute_dtype, remat_block)
    grads = reduce_over_data(grads, plan.base_params, plan.grad_shardings, plan.mesh)
    terms = dict(zip(loss_terms(plan.model), losses.mean(0)))
    return terms.pop(OBJECTIVE), moe_metrics(terms), grads


def replica_grads(plan: Plan, params: dict, batch: dict, compute_dtype=jnp.float32,
                  remat_block=lambda f: f):
    """Per-data-replica (loss terms [n_data, terms], gradients with a leading data
    dimension)."""
    losses, (d_blocks, d_shared) = _run(plan, params, batch, compute_dtype, remat_block)
    return losses, {**d_shared, BLOCKS: d_blocks}


def pipeline_loss(plan: Plan, params: dict, batch: dict, compute_dtype=jnp.float32):
    """Mean cross-entropy of a forward-only pass of the schedule (evaluation): every stage
    runs only the blocks it stores, so a model that needs stages to fit is never gathered."""
    terms = dict(zip(loss_terms(plan.model), _run(plan, params, batch, compute_dtype,
                                                  train=False).mean(0)))
    return terms.get(CROSS_ENTROPY, terms[OBJECTIVE])


def _run(plan: Plan, params: dict, batch: dict, compute_dtype, remat_block=lambda f: f,
         train: bool = True):
    """The kernel over every (stage, data replica): losses [n_data] and, when training,
    per-replica (block, shared) gradients."""
    mesh, config = plan.mesh, plan.pipeline
    table = config.table(mesh.shape[ax.STAGE], forward_only=not train)
    blocks = params[BLOCKS]
    shared = {k: v for k, v in params.items() if k != BLOCKS}
    program = functools.partial(stage_program.program, plan=plan, table=table,
                                compute_dtype=compute_dtype, remat_block=remat_block,
                                train=train)
    on_stage = lambda tree, *lead: jax.tree.map(lambda _: PartitionSpec(*lead, ax.STAGE), tree)
    replicated = lambda tree, *lead: jax.tree.map(lambda _: PartitionSpec(*lead), tree)
    batch_spec = PartitionSpec(ax.DATA)
    grad_specs = (on_stage(blocks, ax.DATA), replicated(shared, ax.DATA))
    run = jax.shard_map(
        program, mesh=mesh,
        in_specs=(on_stage(blocks), replicated(shared), batch_spec, batch_spec),
        out_specs=(batch_spec, grad_specs) if train else batch_spec,
        axis_names=frozenset({ax.STAGE, ax.DATA}),
        # Every value inside is per device and every collective is written out: autodiff
        # happens per micro-batch inside the kernel, never through it.
        check_vma=False)
    return run(blocks, shared, batch["inputs"], batch["targets"])


def with_pipeline(plan: Plan, config: PipelineConfig | None) -> Plan:
    """The plan, pipelined when its mesh has more than one stage."""
    if config is None or plan.mesh.shape[ax.STAGE] == 1:
        return plan
    return dataclasses.replace(plan, pipeline=config)



def pipeline_for(flags, model, mesh) -> PipelineConfig | None:
    """The pipeline a run's flags ask for (`--microbatches`, `--pp-schedule`,
    `--pp-virtual-stages`), checked; None when the mesh has one stage."""
    config = PipelineConfig(flags.pp_schedule, flags.microbatches, flags.pp_virtual_stages)
    if mesh.shape[ax.STAGE] == 1:
        require(config.microbatches == 0 and config.virtual == 1 and not flags.pp_show_schedule,
                "--microbatches, --pp-virtual-stages and --pp-show-schedule pipeline the "
                "model over stages; add pp=P to --mesh")
        return None
    check_pipeline(config, model, mesh, flags.batch_size, flags.grad_accum)
    return config


def show_schedule(plan: Plan) -> str:
    """The executed schedule of a pipelined plan as a printable stage x tick grid."""
    return plan.pipeline.table(plan.mesh.shape[ax.STAGE]).render()
