"""Loss and gradients of one global batch: the one gradient path of every layout.

Everything runs inside one `jax.shard_map` that is manual over the replica axes (`data`,
`fsdp`; `jdist.spmd.axes.REPLICA_AXES`) and leaves the others (`sequence`, `expert`, `tensor`)
to the partitioner and to the kernels the model is handed (`jdist.step.forward`). Each
replica differentiates its own tokens with respect to its block of the *gradient layout*
(`jdist.parallel.grad_sync`): parameters are gathered just in time per layer, and each
layer's gradient is reduced over the replicas, in float32, as the backward produces it (an
all-reduce under ZeRO-0/1, a reduce-scatter into the sharded layout under ZeRO-2/3 and over
fsdp). With `grad_accum` micro-batches a `lax.scan` accumulates: under ZeRO-0/1 locally,
all-reduced once at the end; under ZeRO-2/3 into the sharded accumulator.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jdist.models import loss as objective
from jdist.models.names import EMBED, is_blocks
from jdist.models.precision import accumulator
from jdist.parallel import embedding, prefetch
from jdist.parallel import grad_sync as gs
from jdist.spmd import axes as ax
from jdist.step import trainable
from jdist.step.forward import Forward, Params, chunk

MANUAL = ax.REPLICA_AXES


def micro_batches(tree, n: int):
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each micro-batch keeps an equal
    share of every replica's rows and splitting moves no data between devices."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1),
                        tree)


def syncs(plan, manual: tuple[str, ...] = MANUAL) -> dict:
    """The `grad_sync.Sync` of every parameter leaf; a block leaf's is that of one layer
    (its leading `layers` dimension is sliced off by the layer loop)."""
    def one(path, leaf, stored, grad, names):
        what = f"parameter {jax.tree_util.keystr(path)}"
        block = is_blocks(path[0])
        drop = 1 if block else 0
        if block:
            assert not gs.manual_part(stored.spec, leaf.ndim, manual)[0], "layers on replicas"
        # Cast to the compute dtype: float matrices (not norms, nor NF4 codes and scales).
        cast = leaf.ndim - drop >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating)
        sync = gs.make_sync(tuple(stored.spec)[drop:], tuple(grad.spec)[drop:],
                            leaf.ndim - drop, plan.mesh, manual, cast, what)
        if path[0].key == EMBED and not embedding.supports(sync):
            # Looked up from the gathered table: rows from float32, so the gradient's
            # scatter-add accumulates in float32. (Else only a tied head uses the copy.)
            return dataclasses.replace(sync, cast=False)
        return sync
    # A frozen parameter has no gradient: its (unused) gradient layout is its stored one.
    grad_shardings = trainable.combine(plan.grad_shardings, plan.shardings.params)
    return jax.tree_util.tree_map_with_path(
        one, plan.abstract.params, plan.shardings.params, grad_shardings, plan.names,
        is_leaf=lambda x: isinstance(x, tuple) or isinstance(x, jax.ShapeDtypeStruct))


def stacked(sync: dict) -> dict:
    """`syncs` for whole parameters: the block leaves' with their `layers` dimension."""
    return {k: jax.tree.map(gs.stacked, v) if is_blocks(k) else v for k, v in sync.items()}


def block_syncs(sync: dict) -> dict:
    """The blocks' `Sync`s by run: `jdist.step.forward.Forward.block_sync`."""
    return {k: v for k, v in sync.items() if is_blocks(k)}


def manual_specs(abstract, shardings, manual: tuple[str, ...] = MANUAL):
    """shard_map specs (manual axes only) of a tree laid out as `shardings`."""
    return jax.tree.map(lambda x, s: gs.in_spec(gs.manual_part(s.spec, x.ndim, manual)),
                        abstract, shardings)


def replica_map(plan, local, out_specs, manual: tuple[str, ...] = MANUAL):
    """`local(stored params, inputs, targets)` as the step's shard_map, manual over
    `manual`: each replica gets its blocks of the stored parameters and its rows of tokens."""
    batch_spec = gs.in_spec(gs.manual_part(plan.batch_sharding.spec, 2, manual))
    return jax.shard_map(
        local, mesh=plan.mesh,
        in_specs=(manual_specs(plan.abstract.params, plan.shardings.params, manual),
                  batch_spec, batch_spec),
        out_specs=out_specs, axis_names=frozenset(manual), check_vma=gs.REPLICA_CHECK_VMA)


def resident(plan, stored: dict) -> dict:
    """The stored parameters as the forward reads them: under `--offload params` the shared
    ones (embedding, final norm, head) come to the device whole, the blocks stay on the
    host for the layer loop to stream (`jdist.parallel.prefetch.run`)."""
    if not plan.streams:
        return stored
    return {k: v if is_blocks(k) else jax.tree.map(prefetch.to_device, v)
            for k, v in stored.items()}


def trained_primal(plan, stored: dict, stacked_syncs: dict) -> dict:
    """The gradient-layout blocks of the trained parameters (None for frozen ones): what
    the step differentiates."""
    return trainable.tree_map(gs.to_grad_layout, trainable.select(plan.model, stored),
                              stacked_syncs)


def accumulated_primal(plan, stored: dict, stacked_syncs: dict) -> dict:
    """`trained_primal` where gradients accumulate (`Plan.grads_stream` false): under
    `--offload params` in device memory, since a custom VJP's cotangent has its primal's
    memory space and the accumulator must be on the device (a host computation cannot take
    part in the scan over micro-batches or ticks); they go to the host once, for the update.
    The layer loop reads the blocks from `stored`, streamed, never this copy."""
    primal = trained_primal(plan, stored, stacked_syncs)
    return jax.tree.map(prefetch.to_device, primal) if plan.streams else primal


def replica_terms(fw: Forward, params: Params, tokens, targets, scale) -> jax.Array:
    """This replica's `jdist.models.loss.loss_terms` for its tokens (the cross-entropy summed over
    counted targets times `scale`, `jdist.models.loss.piece_cross_entropy`): the whole model as
    one chunk (`jdist.step.forward.chunk`)."""
    tokens, targets, segments, positions = fw.in_kernel_order(tokens, targets)
    return chunk(fw, params.shared(), params.blocks(), None, tokens, targets, positions, segments,
                 scale)[1]


def step_grads(plan, params: dict, batch: dict) -> tuple[jax.Array, dict, int]:
    """(the objective's terms averaged over one global batch, gradients, micro-batches):
    what `jdist.step.build.gradients` turns into the step's result."""
    sync = syncs(plan)
    stacked_syncs = stacked(sync)
    micro = plan.compute.grad_accum
    defer = micro > 1
    n_replicas = replica_count(plan.mesh)
    goal = objective.Objective(plan.model)

    def local(stored, tokens, targets):
        stored = resident(plan, stored)
        primal = trained_primal(plan, stored, stacked_syncs) if micro == 1 else \
            accumulated_primal(plan, stored, stacked_syncs)
        # Read, never differentiated: else the layer loop's transpose builds a (zero)
        # cotangent for the stored stack too, a full extra gradient buffer.
        stored = jax.lax.stop_gradient(stored)
        scale = goal.scale(micro * n_replicas, targets, MANUAL)

        fw = Forward(plan, MANUAL, defer, tokens.shape[1], block_syncs(sync))

        def micro_loss(primal, tok, tgt):
            terms = replica_terms(fw, Params(primal, stored, sync), tok, tgt, scale)
            return terms[0] / micro, terms

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
        if micro == 1:
            (_, terms), grads = grad_fn(primal, tokens, targets)
        else:
            def body(carry, mb):
                terms_sum, acc = carry
                (_, terms), g = grad_fn(primal, *mb)
                return (terms_sum + terms, jax.tree.map(jnp.add, acc, g)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), primal)
            start = (jnp.zeros(goal.n_terms, accumulator(plan.compute.dtype)), zeros)
            (terms, grads), _ = jax.lax.scan(body, start, micro_batches((tokens, targets), micro))
            terms = terms / micro
            grads = trainable.tree_map(gs.finish_reduce, grads, sync)
        return jax.lax.psum(terms, MANUAL) / n_replicas, grads

    grad_specs = manual_specs(trainable.select(plan.model, plan.abstract.params),
                              plan.grad_shardings)
    run = replica_map(plan, local, (PartitionSpec(), grad_specs))
    terms, grads = run(params, batch["inputs"], batch["targets"])
    return terms, grads, micro


def step_eval(plan, params: dict, batch: dict) -> jax.Array:
    """Mean cross-entropy of a global batch (no balancing terms), by the same forward."""
    sync, goal = syncs(plan), objective.Objective(plan.model)

    def local(stored, tokens, targets):
        stored = resident(plan, stored)
        scale = goal.scale(replica_count(plan.mesh), targets, MANUAL)
        fw = Forward(plan, MANUAL, False, tokens.shape[1], block_syncs(sync))
        terms = replica_terms(fw, Params(stored, stored, sync), tokens, targets, scale)
        ce = goal.cross_entropy(terms)
        return jax.lax.psum(ce, MANUAL) / replica_count(plan.mesh)

    return replica_map(plan, local, PartitionSpec())(params, batch["inputs"], batch["targets"])


def replica_count(mesh, axes=MANUAL) -> int:
    """How many replicas `axes` make: the gradient is their mean."""
    return math.prod(mesh.shape[a] for a in axes)
