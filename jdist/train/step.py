"""The jitted training and evaluation steps: next-token cross-entropy, AdamW update.

Parallelism lives entirely in the shardings of the inputs and outputs (from the plan)
and in the activation constraints the model places by logical name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdist.rules import activation_sharding
from jdist.sharding import replicated
from jdist.train.state import Plan, TrainState


def loss_fn(plan: Plan, params: dict, batch: dict, compute_dtype=jnp.float32) -> jax.Array:
    """Mean next-token cross-entropy. Matmuls run in `compute_dtype`; the loss in float32."""
    compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    with activation_sharding(plan.mesh, plan.rules):
        logits = nnx.merge(plan.graphdef, compute)(batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"])
    return losses.mean()


def make_train_step(plan: Plan, schedule: optax.Schedule | None = None,
                    compute_dtype=jnp.float32):
    """`step(state, batch) -> (state, metrics)`, jitted with the plan's shardings; the old
    state is donated so parameters and optimizer state are updated in place."""

    def step(state: TrainState, batch: dict):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(plan, p, batch, compute_dtype))(
            state.params)
        updates, opt_state = plan.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}
    return jax.jit(step, in_shardings=(plan.shardings, batch_sh),
                   out_shardings=(plan.shardings, replicated(plan.mesh)), donate_argnums=0)


def make_eval_step(plan: Plan, compute_dtype=jnp.float32):
    """`eval_step(params, batch) -> loss`, jitted."""
    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}
    return jax.jit(lambda params, batch: loss_fn(plan, params, batch, compute_dtype),
                   in_shardings=(plan.shardings.params, batch_sh),
                   out_shardings=replicated(plan.mesh))
