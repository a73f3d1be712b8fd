"""Loss and gradients of one global batch: per data replica, over micro-batches, reduced
over `data` with the collective the ZeRO stage calls for.

Each data replica differentiates its own share of the batch (`jax.vmap` with
`spmd_axis_name`, so GSPMD keeps every replica on its own devices and still handles fsdp,
tensor and sequence sharding inside); `jdist.zero.reduce_over_data` then all-reduces
(ZeRO-0/1) or reduce-scatters (ZeRO-2/3) the replicas' gradients explicitly. With
`grad_accum > 1` a `lax.scan` runs the micro-batches and sums the *reduced* gradients, so
under ZeRO-2/3 the accumulator is sharded over data too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jdist import axes as ax
from jdist.rules import without_axis
from jdist.train.state import Plan
from jdist.zero import reduce_over_data


def split_leading(tree, n: int):
    """[B, ...] -> [n, B/n, ...] (contiguous rows: the layout data sharding already has)."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), tree)


def micro_batches(tree, n: int):
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each micro-batch keeps an equal
    share of every replica's rows and splitting moves no data between devices."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1),
                        tree)


def replica_grads(plan: Plan, loss: Callable, params: dict, batch: dict):
    """Per-replica ((loss, metrics), gradients), each with a leading `data` dimension.
    `loss(plan, params, batch) -> (scalar, metrics)`; inside it, `plan.replica_axis` names
    the replicas for the few quantities that need a cross-replica sum (MoE balancing)."""
    n = plan.mesh.shape[ax.DATA]
    inner = dataclasses.replace(plan, rules=without_axis(plan.rules, ax.DATA),
                                replica_axis=ax.DATA)
    grad_fn = jax.value_and_grad(lambda p, b: loss(inner, p, b), has_aux=True)
    return jax.vmap(grad_fn, in_axes=(None, 0), axis_name=ax.DATA, spmd_axis_name=ax.DATA)(
        params, split_leading(batch, n))


def reduced_grads(plan: Plan, loss: Callable, params: dict, batch: dict):
    """Mean loss, mean metrics and gradients of `batch`, laid out as `plan.grad_shardings`."""
    (losses, metrics), grads = replica_grads(plan, loss, params, batch)
    grads = reduce_over_data(grads, plan.base_params, plan.grad_shardings, plan.mesh)
    return losses.mean(), jax.tree.map(lambda m: m.mean(0), metrics), grads


def accumulated_grads(plan: Plan, loss: Callable, params: dict, batch: dict, grad_accum: int):
    """(mean loss, mean metrics, gradients) over `grad_accum` micro-batches: the same
    numbers as one big batch (MoE load fractions excepted: they are per micro-batch), with
    one micro-batch of activations alive at a time."""
    if grad_accum == 1:
        return reduced_grads(plan, loss, params, batch)

    def zeros(leaf, sharding):
        return jax.lax.with_sharding_constraint(jnp.zeros(leaf.shape, jnp.float32), sharding)

    def body(carry, micro):
        loss_sum, grad_sum = carry
        micro_loss, metrics, grads = reduced_grads(plan, loss, params, micro)
        return (loss_sum + micro_loss, jax.tree.map(jnp.add, grad_sum, grads)), metrics

    start = (jnp.zeros((), jnp.float32), jax.tree.map(zeros, params, plan.grad_shardings))
    (loss_sum, grad_sum), metrics = jax.lax.scan(body, start, micro_batches(batch, grad_accum))
    return (loss_sum / grad_accum, jax.tree.map(lambda m: m.mean(0), metrics),
            jax.tree.map(lambda g: g / grad_accum, grad_sum))
