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

import jax
from jax.sharding import PartitionSpec

from jdist.models import loss as objective
from jdist.models.names import BLOCKS
from jdist.parallel import grad_sync as gs
from jdist.parallel.pipeline import check_remat, stashes
from jdist.parallel.pipeline import program as stage_program
from jdist.parallel.pipeline import shared as stage_shared
from jdist.spmd import axes as ax
from jdist.step import trainable
from jdist.step.forward import Forward, Params, chunk
from jdist.step.grads import (
    MANUAL,
    block_syncs,
    manual_specs,
    micro_batches,
    replica_count,
    replica_map,
    stacked,
    syncs,
    trained_primal,
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
        stored = stage_shared.gather(stored, plan.shardings.params, sync)
        scale = goal.scale(table.micro * n_replicas, targets, MANUAL)
        tokens, labels, segments, positions = fw.in_kernel_order(inputs, targets)
        tokens, labels = micro_batches((tokens, labels), table.micro)
        if segments is not None:  # packed documents: per-row layouts, per micro-batch
            segments, positions = micro_batches((segments, positions), table.micro)
        primal = trained_primal(plan, stored, stacked_syncs) if train else stored
        stored = jax.lax.stop_gradient(stored)  # read only (see jdist.step.grads)
        shared = Params(primal, stored, sync).shared()
        stored_chunks = jax.tree.map(
            lambda b: b.reshape(table.virtual, -1, *b.shape[1:]), stored[BLOCKS])
        per_chunk = plan.model.n_layers // table.chunks  # layers in each chunk

        def chunk_fn(v, block, shared_primal, x_in, m, first, last):
            """Chunk v of micro-batch m (`jdist.step.forward.chunk`)."""
            at = (lambda a: a) if segments is None else (lambda a: a[m])
            blocks = Params({BLOCKS: block}, {BLOCKS: jax.tree.map(lambda b: b[v], stored_chunks)},
                            {BLOCKS: sync[BLOCKS]})
            first_layer = (jax.lax.axis_index(ax.STAGE) * table.virtual + v) * per_chunk
            return chunk(fw, shared._replace(primal=shared_primal), blocks, x_in,
                         tokens[m], labels[m], at(positions), at(segments), scale, first,
                         last, first_layer)

        out = stage_program.program(
            primal[BLOCKS], shared.primal, table=table, chunk_fn=chunk_fn,
            act_shape=(*tokens.shape[1:], plan.model.d_model), act_dtype=plan.compute.dtype,
            n_terms=goal.n_terms, train=train, stash_residuals=stash)
        terms, grads = out if train else (out, None)
        terms = jax.lax.psum(terms, PIPE_MANUAL) / n_replicas  # only the last stage has ce
        if not train:
            return terms
        d_blocks, d_shared = grads
        # The first stage's embedding gradient, the last's head gradient (ZB-V: both on
        # the first), into their split over `stage`.
        d_shared = stage_shared.reduce(d_shared, {k: plan.grad_shardings[k] for k in d_shared},
                                       {k: sync[k] for k in d_shared})
        grads = {**d_shared, BLOCKS: d_blocks}
        return terms, trainable.tree_map(gs.finish_reduce, grads, sync)

    out_specs = PartitionSpec()
    if train:
        out_specs = (out_specs, manual_specs(trainable.select(plan.model, plan.abstract.params),
                                             plan.grad_shardings, PIPE_MANUAL))
    run = replica_map(plan, local, out_specs, PIPE_MANUAL)
    return run(params, batch["inputs"], batch["targets"])


def pipeline_grads(plan, params: dict, batch: dict) -> tuple[jax.Array, dict, int]:
    """(mean terms, gradients, micro-batches) like `jdist.step.grads.step_grads`, computed
    by the pipeline schedule."""
    terms, grads = _run(plan, params, batch, train=True)
    return terms, grads, plan.pipeline.table(plan.mesh.shape[ax.STAGE]).micro


def pipeline_eval(plan, params: dict, batch: dict) -> jax.Array:
    """Mean cross-entropy of a forward-only pass of the schedule: every stage runs only the
    blocks it stores, so a model that needs stages to fit is never gathered."""
    return objective.Objective(plan.model).cross_entropy(_run(plan, params, batch, train=False))
