"""Loss and gradients of one global batch when the mesh has pipeline stages: the same
gradient path as `jdist.step.grads` (replica shard_map, per-layer float32 gather and
reduction by `jdist.parallel.grad_sync`, one objective from `jdist.models.loss`), with the
micro-batches run by the stage schedule (`jdist.parallel.pipeline.program`).

The shard_map is manual over `stage` too. A stage holds its contiguous shard of the stored
layer stack (its chunks; `jdist.parallel.pipeline.layer_order`), and 1/P of the embedding and head
(`jdist.parallel.pipeline.shared`), gathered over `stage` before the ticks: the first chunk
embeds, the last computes the cross-entropy. Their gradients (zero on the stages that do
not use them) are reduce-scattered over `stage` once per step; block gradients never
leave their stage. Under ZeRO-0/1 the micro-batches accumulate
locally and are all-reduced once; under ZeRO-2/3 each layer's gradient is reduce-scattered
in every backward tick, into the sharded accumulator.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec

from jdist.models import loss as objective
from jdist.models.names import BLOCKS
from jdist.models.runs import heterogeneous, moe_offset, runs
from jdist.parallel import grad_sync as gs
from jdist.parallel.pipeline import check_remat, stashes
from jdist.parallel.pipeline import program as stage_program
from jdist.parallel.pipeline import shared as stage_shared
from jdist.spmd import axes as ax
from jdist.step import trainable
from jdist.step.forward import Forward, Params, chunk
from jdist.step.grads import (
    MANUAL,
    accumulated_primal,
    block_syncs,
    manual_specs,
    micro_batches,
    replica_count,
    replica_map,
    resident,
    stacked,
    syncs,
)

PIPE_MANUAL = (ax.STAGE, *MANUAL)


def _run(plan, params: dict, batch: dict, train: bool):
    mesh = plan.mesh
    check_remat(plan.pipeline, plan.compute.remat)  # a plan's remat may change after planning
    stash = train and stashes(plan.compute.remat)
    table = plan.pipeline.table(mesh.shape[ax.STAGE], forward_only=not train, stash=stash)
    sync = syncs(plan)
    stacked_syncs = stacked(sync)
    n_replicas = replica_count(mesh)
    goal = objective.Objective(plan.model)
    # Micro-batches accumulate: ZeRO-0/1 gradients are all-reduced once, below.
    fw = Forward(plan, PIPE_MANUAL, True, batch["inputs"].shape[1], block_syncs(sync))

    def local(stored, inputs, targets):
        # The embedding and head are stored split over `stage`: whole for the ticks.
        # Under --offload params the blocks stay on the host for the layer loop to stream.
        stored = stage_shared.gather(resident(plan, stored), plan.shardings.params, sync)
        scale = goal.scale(table.micro * n_replicas, targets, MANUAL)
        tokens, labels, segments, positions = fw.in_kernel_order(inputs, targets)
        tokens, labels = micro_batches((tokens, labels), table.micro)
        if segments is not None:  # packed documents: per-row layouts, per micro-batch
            segments, positions = micro_batches((segments, positions), table.micro)
        # --offload params: the stage accumulates its blocks' gradients over the ticks on
        # the device (a host computation cannot take part in the schedule's loop).
        primal = accumulated_primal(plan, stored, stacked_syncs) if train else stored
        stored = jax.lax.stop_gradient(stored)  # read only (see jdist.step.grads)
        shared = Params(primal, stored, sync).shared()

        def one_chunk(blocks: Params, first_layer, shared_primal, x_in, m, first, last):
            """A chunk of micro-batch m (`jdist.step.forward.chunk`)."""
            at = (lambda a: a) if segments is None else (lambda a: a[m])
            return chunk(fw, shared._replace(primal=shared_primal), blocks, x_in,
                         tokens[m], labels[m], at(positions), at(segments), scale, first,
                         last, first_layer)

        if heterogeneous(plan.model):  # chunk v is run v's share of this stage
            chunk_fn = partial(_run_chunk, plan, one_chunk, stored)
            blocks = tuple(primal[r.key] for r in runs(plan.model))
        else:
            chunk_fn = partial(_stack_chunk, plan, table, one_chunk, stored[BLOCKS])
            blocks = primal[BLOCKS]
        out = stage_program.program(
            blocks, shared.primal, table=table, chunk_fn=chunk_fn,
            act_shape=(*tokens.shape[1:], plan.model.d_model), act_dtype=plan.compute.dtype,
            n_terms=goal.n_terms, train=train, stash_residuals=stash,
            by_chunk=heterogeneous(plan.model))
        terms, grads = out if train else (out, None)
        terms = jax.lax.psum(terms, PIPE_MANUAL) / n_replicas  # only the last stage has ce
        if not train:
            return terms
        d_blocks, d_shared = grads
        # The first stage's embedding gradient, the last's head gradient (ZB-V: both on
        # the first), into their split over `stage`.
        d_shared = stage_shared.reduce(d_shared, {k: plan.grad_shardings[k] for k in d_shared},
                                       {k: sync[k] for k in d_shared})
        d_blocks = dict(zip((r.key for r in runs(plan.model)), d_blocks)) \
            if heterogeneous(plan.model) else {BLOCKS: d_blocks}
        grads = {**d_shared, **d_blocks}
        return terms, trainable.tree_map(gs.finish_reduce, grads, sync)

    out_specs = PartitionSpec()
    if train:
        out_specs = (out_specs, manual_specs(trainable.select(plan.model, plan.abstract.params),
                                             plan.grad_shardings, PIPE_MANUAL))
    run = replica_map(plan, local, out_specs, PIPE_MANUAL)
    return run(params, batch["inputs"], batch["targets"])


def _stack_chunk(plan, table, one_chunk, stored, v, block, *rest):
    """Chunk v of this stage's share of one stack: its layers' rows of `stored` (the
    stage's chunks, one after another), differentiating `block`."""
    chunks = jax.tree.map(lambda b: b.reshape(table.virtual, -1, *b.shape[1:]), stored)
    per_chunk = plan.model.n_layers // table.chunks  # layers in each chunk
    first_layer = (jax.lax.axis_index(ax.STAGE) * table.virtual + v) * per_chunk
    blocks = Params({BLOCKS: block}, {BLOCKS: jax.tree.map(lambda b: b[v], chunks)}, {})
    return one_chunk(blocks, first_layer, *rest)


def _run_chunk(plan, one_chunk, stored, v, blocks, *rest):
    """Chunk v of a heterogeneous stack (`models.runs`): run v's share of this stage (its
    rows of `stored`, differentiating `blocks[v]`), the other runs' stacks empty. Their
    shapes differ, so the chunk is a `lax.switch` over v, each branch one run."""
    model_runs = runs(plan.model)

    def branch(r, blocks, *rest):
        run, stage = model_runs[r], jax.lax.axis_index(ax.STAGE)
        mine = lambda i, tree: tree if i == r else jax.tree.map(lambda b: b[:0], tree)
        chunk_blocks = Params(*({q.key: mine(i, t[i]) for i, q in enumerate(model_runs)}
                                for t in (blocks, [stored[q.key] for q in model_runs])), {})
        # Its loads' rows: the run's first, then this stage's share before it.
        first_layer = moe_offset(plan.model, run) + stage * (run.n_layers // plan.mesh.shape[
            ax.STAGE])
        return one_chunk(chunk_blocks, first_layer, *rest)

    return jax.lax.switch(v, [partial(branch, r) for r in range(len(model_runs))], blocks,
                          *rest)


def pipeline_grads(plan, params: dict, batch: dict) -> tuple[jax.Array, dict, int]:
    """(mean terms, gradients, micro-batches) like `jdist.step.grads.step_grads`, computed
    by the pipeline schedule."""
    terms, grads = _run(plan, params, batch, train=True)
    return terms, grads, plan.pipeline.table(plan.mesh.shape[ax.STAGE]).micro


def pipeline_eval(plan, params: dict, batch: dict) -> jax.Array:
    """Mean cross-entropy of a forward-only pass of the schedule: every stage runs only the
    blocks it stores, so a model that needs stages to fit is never gathered."""
    return objective.Objective(plan.model).cross_entropy(_run(plan, params, batch, train=False))
