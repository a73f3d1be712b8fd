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
pipeline; `fsdp`, `tensor` stay automatic, so GSPMD shards each stage's work as usual). At
each tick a stage runs one operation from the table - nothing, a forward, or a backward of
one micro-batch on one chunk - and then two `ppermute`s pass the forward output to the next
stage and the input cotangent to the previous one. A backward recomputes its chunk's
forward from the stashed chunk input (`jax.vjp` per micro-batch, as GPipe does) so a stage
holds only the inputs of its in-flight micro-batches: all M of them under gpipe, about P
under 1f1b. Per-replica gradients then go through the same ZeRO reduction as without
pipelining (`jdist.zero.reduce_over_data`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from jdist import axes as ax
from jdist.errors import require
from jdist.parallel import schedule as sched
from jdist.parallel.context import ContextParallel, context_parallel
from jdist.parallel.layer_order import BLOCKS
from jdist.parallel.moe import moe_losses
from jdist.rules import activation_sharding, without_axis
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
    context = mesh.shape[ax.SEQUENCE] > 1
    # XLA's limit on jax 0.10: with tp, a kernel nested in the stage's shard_map aborts the
    # SPMD partitioner (a CHECK failure kills the process). Refused rather than risked.
    require(not ((context or model.n_experts) and mesh.shape[ax.TENSOR] > 1),
            f"pipeline stages with tp={mesh.shape[ax.TENSOR]} cannot run "
            f"{'MoE' if model.n_experts else 'context-parallel'} kernels yet; drop tp from "
            "--mesh (use fsdp or more stages) or use pp=1")
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
    return terms.pop(OBJECTIVE), terms, grads


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


OBJECTIVE, CROSS_ENTROPY = "loss", "ce_loss"


def loss_terms(model) -> tuple[str, ...]:
    """What each micro-batch's loss vector holds: the objective (differentiated), and for
    MoE models the terms the step reports (as `jdist.train.step.loss_and_metrics` does)."""
    if not model.n_experts:
        return (OBJECTIVE,)  # the cross-entropy itself
    return (OBJECTIVE, CROSS_ENTROPY, "moe_aux_loss", "moe_z_loss")


def _moe_terms(model, stats: dict, ce: jax.Array) -> tuple[jax.Array, ...]:
    """A chunk's part of the micro-batch's `loss_terms` for an MoE model: the objective is
    the cross-entropy plus the weighted balancing losses. Each layer's loss needs its load
    fraction f_e over every data replica's tokens of the micro-batch (counts carry no
    gradient) and P_e, z over this replica's, as without a pipeline; the mean over layers
    becomes a sum of per-chunk shares."""
    total = jax.lax.psum(jax.lax.stop_gradient(stats), ax.DATA)
    balance = moe_losses(stats, total, model)
    share = stats["tokens"].shape[0] / model.n_layers  # this chunk's layers / all layers
    objective = ce + share * (model.aux_loss_weight * balance["aux_loss_local"]
                              + model.z_loss_weight * balance["z_loss_local"])
    return (objective, ce, share * balance["moe_aux_loss"], share * balance["moe_z_loss"])


def _run(plan: Plan, params: dict, batch: dict, compute_dtype, remat_block=lambda f: f,
         train: bool = True):
    """The kernel over every (stage, data replica): losses [n_data] and, when training,
    per-replica (block, shared) gradients."""
    mesh, config = plan.mesh, plan.pipeline
    table = config.table(mesh.shape[ax.STAGE], forward_only=not train)
    blocks = params[BLOCKS]
    shared = {k: v for k, v in params.items() if k != BLOCKS}
    program = functools.partial(_program, plan=plan, table=table, compute_dtype=compute_dtype,
                                remat_block=remat_block, train=train)
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


def _columns(table: sched.Schedule) -> np.ndarray:
    """The schedule as int32 [ticks, 7, stages]: kind, micro-batch, chunk and the slots."""
    kind = [[op.kind if op else sched.IDLE for op in row] for row in table.grid]
    micro = [[op.micro if op else 0 for op in row] for row in table.grid]
    chunk = [[op.chunk if op else 0 for op in row] for row in table.grid]
    return np.stack([np.array(x, np.int32) for x in (
        kind, micro, chunk, table.in_slot, table.grad_slot, table.recv_fwd, table.recv_bwd)],
        axis=1)


def _program(blocks, shared, inputs, targets, *, plan: Plan, table: sched.Schedule,
             compute_dtype, remat_block, train: bool):
    """One (stage, data replica)'s share of the step: run every tick of `table`."""
    stages, virtual, micro = table.stages, table.virtual, table.micro
    last_chunk = stages * virtual - 1
    stage = jax.lax.axis_index(ax.STAGE)
    chunks = jax.tree.map(lambda b: b.reshape(virtual, -1, *b.shape[1:]), blocks)
    inner_rules = without_axis(without_axis(plan.rules, ax.DATA), ax.STAGE)
    # Context parallelism inside a stage: tokens in the attention kernel's (load-balanced)
    # order, with their rotary positions, as `jdist.train.step.loss_and_metrics` does.
    cp = ContextParallel(plan.mesh, inner_rules, plan.cp_strategy)
    positions = cp.positions(inputs.shape[1])
    tokens, labels = _split(cp.reorder(inputs), micro), _split(cp.reorder(targets), micro)
    act = jnp.zeros((*tokens.shape[1:], plan.model.d_model), compute_dtype)
    zero = jnp.zeros((), jnp.float32)
    moe = bool(plan.model.n_experts)
    no_loss = jnp.zeros(len(loss_terms(plan.model)), jnp.float32)
    cyclic = virtual > 1  # the last stage's chunk v feeds the first stage's chunk v+1
    to_next = [(i, (i + 1) % stages) for i in range(stages if cyclic else stages - 1)]
    to_prev = [(j, i) for i, j in to_next]

    def chunk_fn(block, shared_, x_in, tok, tgt, first, last):
        """Chunk forward: (output activation, this chunk's part of the micro-batch's
        `loss_terms`: the cross-entropy if last, MoE balancing terms of its layers)."""
        cast = lambda t: jax.tree.map(lambda p: p.astype(compute_dtype), t)
        model = nnx.merge(plan.graphdef, {**cast(shared_), BLOCKS: cast(block)})
        x = jax.lax.cond(first, lambda: model.embed_tokens(tok), lambda: x_in)
        y, stats = model.run_blocks(x, remat_block, positions)
        ce = jax.lax.cond(last, lambda: optax.softmax_cross_entropy_with_integer_labels(
            model.logits(y).astype(jnp.float32), tgt).mean(), lambda: zero)
        return y, jnp.stack(_moe_terms(plan.model, stats, ce) if moe else (ce,))

    def tick(carry, row):
        stash, grads_in, acc, loss_sum = carry
        kind, m, v, in_slot, grad_slot, recv_fwd, recv_bwd = (row[i][stage] for i in range(7))
        c = v * stages + stage
        first, last = c == 0, c == last_chunk
        block = jax.tree.map(lambda b: b[v], chunks)
        x_in = stash[jnp.maximum(in_slot, 0)]
        f = lambda blk, sh, x: chunk_fn(blk, sh, x, tokens[m], labels[m], first, last)

        def idle():
            return act, act, acc, no_loss

        def forward():
            y, loss = f(block, shared, x_in)
            return y, act, acc, loss

        def backward():  # recompute the chunk, then pull back this micro-batch's cotangent
            _, pullback = jax.vjp(f, block, shared, x_in)
            cot_y = jnp.where(last, act, grads_in[jnp.maximum(grad_slot, 0)])
            # The objective (term 0) of each micro-batch weighs 1/M in the step's mean.
            d_block, d_shared, d_x = pullback((cot_y, no_loss.at[0].set(1.0 / micro)))
            d_chunks = jax.tree.map(lambda a, g: a.at[v].add(g), acc[0], d_block)
            return act, d_x, (d_chunks, jax.tree.map(jnp.add, acc[1], d_shared)), no_loss

        ops = (idle, forward, backward) if train else (idle, forward)
        y, d_x, acc, loss = jax.lax.switch(kind, ops)
        stash = _store(stash, recv_fwd, jax.lax.ppermute(y, ax.STAGE, to_next))
        if train:
            grads_in = _store(grads_in, recv_bwd, jax.lax.ppermute(d_x, ax.STAGE, to_prev))
        return (stash, grads_in, acc, loss_sum + loss), None

    f32_zeros = lambda t: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), t)
    start = (jnp.zeros((table.n_slots, *act.shape), compute_dtype),
             jnp.zeros((table.n_grad_slots, *act.shape), compute_dtype) if train else (),
             (f32_zeros(chunks), f32_zeros(shared)) if train else (), no_loss)
    with activation_sharding(plan.mesh, inner_rules), \
            context_parallel(plan.mesh, inner_rules, plan.cp_strategy):
        (_, _, acc, loss_sum), _ = jax.lax.scan(tick, start, jnp.asarray(_columns(table)))
    if not train:  # only the last stage saw losses
        return jax.lax.psum(loss_sum / micro, ax.STAGE)[None]
    # Only the first (embedding) and last (head) stages have shared gradients: one sum over
    # stage makes them whole and replicated, with the loss.
    d_chunks, d_shared = acc
    loss, d_shared = jax.lax.psum((loss_sum / micro, d_shared), ax.STAGE)
    d_blocks = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), d_chunks)
    lead = lambda t: jax.tree.map(lambda g: g[None], t)
    return loss[None], (lead(d_blocks), lead(d_shared))


def _split(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...] taking every n-th row (rows stay on their fsdp shard)."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """buffer[slot] = value, or unchanged when slot < 0 (nothing arrived)."""
    i = jnp.maximum(slot, 0)
    return jax.lax.dynamic_update_index_in_dim(
        buffer, jnp.where(slot >= 0, value, buffer[i]), i, 0)


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
