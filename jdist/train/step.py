"""The jitted training and evaluation steps: next-token cross-entropy, AdamW update.

Parallelism lives entirely in the shardings of the inputs and outputs (from the plan)
and in the activation constraints the model places by logical name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdist import remat
from jdist.parallel.context import context_parallel
from jdist.parallel.moe import moe_losses
from jdist.parallel.pipeline import pipeline_grads, pipeline_loss
from jdist.parallel.stage_program import CROSS_ENTROPY
from jdist.rules import activation_sharding
from jdist.sharding import replicated
from jdist.train.grads import accumulated_grads
from jdist.train.state import Plan, TrainState


def loss_and_metrics(plan: Plan, params: dict, batch: dict, compute_dtype=jnp.float32,
                     remat_block=lambda f: f) -> tuple[jax.Array, dict]:
    """The training objective and its extra metrics. Next-token cross-entropy (matmuls in
    `compute_dtype`, the loss in float32), plus the weighted MoE balancing losses.

    Under context parallelism tokens and targets are first moved into the attention
    kernel's (load-balanced) order, with their positions; a mean over tokens is unchanged."""
    compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    moe = bool(plan.model.n_experts)
    with activation_sharding(plan.mesh, plan.rules), \
            context_parallel(plan.mesh, plan.rules, plan.cp_strategy) as cp:
        out = nnx.merge(plan.graphdef, compute)(
            cp.reorder(batch["inputs"]), remat_block=remat_block,
            positions=cp.positions(batch["inputs"].shape[1]), with_aux=moe)
    logits, stats = out if moe else (out, None)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), cp.reorder(batch["targets"])).mean()
    if not moe:
        return loss, {}
    total = jax.lax.psum(stats, plan.replica_axis) if plan.replica_axis else stats
    balance = moe_losses(stats, total, plan.model)
    aux, z = balance.pop("aux_loss_local"), balance.pop("z_loss_local")
    objective = loss + plan.model.aux_loss_weight * aux + plan.model.z_loss_weight * z
    return objective, {CROSS_ENTROPY: loss, **balance}


def loss_fn(plan: Plan, params: dict, batch: dict, compute_dtype=jnp.float32,
            remat_block=lambda f: f) -> jax.Array:
    """The training objective alone (see `loss_and_metrics`)."""
    return loss_and_metrics(plan, params, batch, compute_dtype, remat_block)[0]


def make_train_step(plan: Plan, schedule: optax.Schedule | None = None,
                    compute_dtype=jnp.float32, grad_accum: int = 1, remat_policy: str = "none"):
    """`step(state, batch) -> (state, metrics)`, jitted with the plan's shardings; the old
    state is donated so parameters and optimizer state are updated in place."""
    remat_block = remat.wrapper(remat_policy)

    def loss(plan_: Plan, params: dict, batch: dict):
        return loss_and_metrics(plan_, params, batch, compute_dtype, remat_block)

    def step(state: TrainState, batch: dict):
        if plan.pipeline is not None:  # stages run their schedule (jdist.parallel.pipeline)
            loss_value, extra, grads = pipeline_grads(plan, state.params, batch, compute_dtype,
                                                      remat_block)
        else:
            loss_value, extra, grads = accumulated_grads(plan, loss, state.params, batch,
                                                         grad_accum)
        # Offloaded optimizer state comes in from host memory for the update only.
        opt_state = jax.device_put(state.opt_state, plan.opt_device_shardings) \
            if plan.offload else state.opt_state
        updates, opt_state = plan.tx.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss_value, "grad_norm": optax.tree.norm(grads), **extra}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}
    return jax.jit(step, in_shardings=(plan.shardings, batch_sh),
                   out_shardings=(plan.shardings, replicated(plan.mesh)), donate_argnums=0)


def make_eval_step(plan: Plan, compute_dtype=jnp.float32):
    """`eval_step(params, batch) -> loss`, jitted."""
    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}

    def cross_entropy(params, batch):  # without MoE balancing terms
        if plan.pipeline is not None:  # each stage runs only the blocks it stores
            return pipeline_loss(plan, params, batch, compute_dtype)
        loss, metrics = loss_and_metrics(plan, params, batch, compute_dtype)
        return metrics.get(CROSS_ENTROPY, loss)

    return jax.jit(cross_entropy,
                   in_shardings=(plan.shardings.params, batch_sh),
                   out_shardings=replicated(plan.mesh))
