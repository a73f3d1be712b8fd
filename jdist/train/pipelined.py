"""Loss and gradients of one global batch when the mesh has pipeline stages: the same
gradient path as `jdist.train.grads` (replica shard_map, per-layer float32 gather and
reduction by `jdist.parallel.grad_sync`, one objective from `jdist.loss`), with the
micro-batches run by the stage schedule (`jdist.parallel.stage_program`).

The shard_map is manual over `stage` too. A stage holds its contiguous shard of the stored
layer stack (its chunks; `jdist.train.layer_order`), and the embedding, final norm and
head replicated over stages: the first chunk embeds, the last computes the cross-entropy.
Their gradients (zero on the stages that do not use them) are summed over `stage` once per
step; block gradients never leave their stage. Under ZeRO-0/1 the micro-batches accumulate
locally and are all-reduced once; under ZeRO-2/3 each layer's gradient is reduce-scattered
in every backward tick, into the sharded accumulator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jdist import axes as ax
from jdist import loss as objective
from jdist.parallel import grad_sync as gs
from jdist.parallel import stage_program
from jdist.train import trainable
from jdist.train.context import (
    context_parallel_of,
    embed_lookup,
    head_of,
    model_context,
    reorder_tokens,
    token_losses,
    unmaterialized,
)
from jdist.train.grads import (
    MANUAL,
    manual_specs,
    materialized,
    micro_batches,
    replica_count,
    replica_map,
    stacked,
    stream_layout,
    syncs,
    trained_primal,
)
from jdist.train.layer_order import BLOCKS, EMBED

PIPE_MANUAL = (ax.STAGE, *MANUAL)


def _run(plan, params: dict, batch: dict, train: bool):
    mesh = plan.mesh
    table = plan.pipeline.table(mesh.shape[ax.STAGE], forward_only=not train)
    sync = syncs(plan)
    stacked_syncs = stacked(sync)
    dtype, model_cfg = plan.compute_dtype, plan.model
    n_terms = len(objective.term_names(model_cfg))
    replica_axes = tuple(a for a in MANUAL if mesh.shape[a] > 1)
    n_replicas = replica_count(mesh)
    cp = context_parallel_of(plan, PIPE_MANUAL)

    def local(stored, inputs, targets):
        segments, positions = stream_layout(plan, cp, inputs)
        if segments is not None:  # packed documents: per-row layouts, per micro-batch
            segments, positions = micro_batches((segments, positions), table.micro)
        scale = objective.piece_scale(table.micro * n_replicas,
                                      jax.lax.psum(objective.token_count(targets), MANUAL))
        tokens = micro_batches(reorder_tokens(cp, inputs), table.micro)
        labels = micro_batches(reorder_tokens(cp, targets), table.micro)
        primal = trained_primal(plan, stored, stacked_syncs) if train else stored
        stored = jax.lax.stop_gradient(stored)  # read only (see jdist.train.grads)
        stored_chunks = jax.tree.map(
            lambda b: b.reshape(table.virtual, -1, *b.shape[1:]), stored[BLOCKS])
        stored_shared = {k: v for k, v in stored.items() if k != BLOCKS}
        defer = True  # micro-batches accumulate: ZeRO-0/1 all-reduce once, below

        def chunk_fn(v, block, shared, x_in, m, first, last):
            """Chunk v's forward: (output activation, its part of the micro-batch's
            `jdist.loss.loss_terms`: the cross-entropy if last, the MoE balancing terms of
            its layers)."""
            def layer_params(layer_state, layer_primal):
                return materialized(layer_primal, nnx.to_pure_dict(layer_state), sync[BLOCKS],
                                    dtype, defer)

            lookup = embed_lookup(plan, PIPE_MANUAL, shared[EMBED], stored_shared[EMBED],
                                  sync[EMBED], defer)
            head = head_of(plan, shared, stored_shared, sync, defer)
            skip = unmaterialized(plan, lookup, head)

            def shared_values():
                return {k: materialized(shared[k], stored_shared[k], sync[k], dtype, defer)
                        if k not in skip else stored_shared[k] for k in stored_shared}

            block_stored = jax.tree.map(lambda b: b[v], stored_chunks)
            ctx = model_context(plan, PIPE_MANUAL, inputs.shape[1], layer_params, block,
                                lookup)

            def model(shared_now):
                return nnx.merge(plan.graphdef, {**shared_now, BLOCKS: block_stored})

            # The shared parameters are gathered only by the chunks that use them (the
            # blocks never read them: the stored blocks stand in).
            x = jax.lax.cond(first, lambda: model(shared_values()).embed_tokens(tokens[m], ctx),
                             lambda: x_in)
            if segments is None:
                y, stats = model(stored_shared).run_blocks(x, ctx, positions)
            else:
                y, stats = model(stored_shared).run_blocks(x, ctx, positions[m], segments[m])
            ce = jax.lax.cond(
                last, lambda: objective.piece_cross_entropy(
                    token_losses(plan, PIPE_MANUAL, model(shared_values()), y, labels[m], ctx,
                                 head), labels[m], scale),
                lambda: jnp.zeros((), jnp.float32))
            share = stats["tokens"].shape[0] / model_cfg.n_layers if model_cfg.n_experts else 1.0
            return y, objective.loss_terms(model_cfg, ce, stats if model_cfg.n_experts else None,
                                           replica_axes, share)

        act_shape = (*tokens.shape[1:], model_cfg.d_model)
        out = stage_program.program(
            primal[BLOCKS], {k: v for k, v in primal.items() if k != BLOCKS},
            table=table, chunk_fn=chunk_fn, act_shape=act_shape, act_dtype=dtype,
            n_terms=n_terms, train=train)
        terms, grads = out if train else (out, None)
        terms = jax.lax.psum(terms, PIPE_MANUAL) / n_replicas  # only the last stage has ce
        if not train:
            return terms
        d_blocks, d_shared = grads
        d_shared = jax.lax.psum(d_shared, ax.STAGE)  # first stage: embedding; last: head
        grads = {**d_shared, BLOCKS: d_blocks}
        return terms, trainable.tree_map(gs.finish_reduce, grads, sync)

    out_specs = PartitionSpec()
    if train:
        out_specs = (out_specs, manual_specs(trainable.select(plan.model, plan.abstract.params),
                                             plan.grad_shardings, PIPE_MANUAL))
    run = replica_map(plan, local, out_specs, PIPE_MANUAL)
    return run(params, batch["inputs"], batch["targets"])


def pipeline_grads(plan, params: dict, batch: dict):
    """(objective, metrics, gradients laid out as `plan.grad_shardings`), like
    `jdist.train.grads.step_grads`, computed by the pipeline schedule."""
    terms, grads = _run(plan, params, batch, train=True)
    grads = jax.lax.with_sharding_constraint(grads, plan.grad_shardings)
    loss, metrics = objective.report(plan.model, terms)
    return loss, metrics, grads


def pipeline_eval(plan, params: dict, batch: dict) -> jax.Array:
    """Mean cross-entropy of a forward-only pass of the schedule: every stage runs only the
    blocks it stores, so a model that needs stages to fit is never gathered."""
    terms = _run(plan, params, batch, train=False)
    names = objective.term_names(plan.model)
    return terms[names.index(objective.CROSS_ENTROPY) if plan.model.n_experts else 0]
