"""The jitted training and evaluation steps: gradients of the objective (`jdist.loss`) by
the one gradient path (`jdist.train.grads`, or the pipeline schedule when the mesh has
stages), then the AdamW update on the sharded state."""

from __future__ import annotations

import jax
import optax

from jdist.sharding import replicated
from jdist.train import trainable
from jdist.train.grads import step_eval, step_grads
from jdist.train.pipelined import pipeline_eval, pipeline_grads
from jdist.train.state import Plan, TrainState


def gradients(plan: Plan, params: dict, batch: dict):
    """(objective, metrics, gradients laid out as `plan.grad_shardings`) of a global batch."""
    if plan.pipeline is not None:  # stages run their schedule (jdist.parallel.pipeline)
        return pipeline_grads(plan, params, batch)
    return step_grads(plan, params, batch)


def make_train_step(plan: Plan, schedule: optax.Schedule | None = None,
                    return_grads: bool = False):
    """`step(state, batch) -> (state, metrics)`, jitted with the plan's shardings; the old
    state is donated so parameters and optimizer state are updated in place. With
    `return_grads` it returns `(state, metrics, gradients)` (the equivalence harness)."""

    def step(state: TrainState, batch: dict):
        loss_value, extra, grads = gradients(plan, state.params, batch)
        # Offloaded optimizer state comes in from host memory for the update only.
        opt_state = jax.device_put(state.opt_state, plan.opt_device_shardings) \
            if plan.offload else state.opt_state
        trained = trainable.select(plan.model, state.params)  # frozen leaves: None
        updates, opt_state = plan.tx.update(grads, opt_state, trained)
        params = trainable.combine(optax.apply_updates(trained, updates), state.params)
        metrics = {"loss": loss_value, "grad_norm": optax.tree.norm(grads), **extra}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        new_state = TrainState(state.step + 1, params, opt_state)
        return (new_state, metrics, grads) if return_grads else (new_state, metrics)

    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}
    out_sh = (plan.shardings, replicated(plan.mesh))
    if return_grads:
        out_sh += (plan.grad_shardings,)
    return jax.jit(step, in_shardings=(plan.shardings, batch_sh), out_shardings=out_sh,
                   donate_argnums=0)


def make_eval_step(plan: Plan):
    """`eval_step(params, batch) -> cross-entropy`, jitted."""
    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}

    def cross_entropy(params, batch):  # without MoE balancing terms
        if plan.pipeline is not None:  # each stage runs only the blocks it stores
            return pipeline_eval(plan, params, batch)
        return step_eval(plan, params, batch)

    return jax.jit(cross_entropy, in_shardings=(plan.shardings.params, batch_sh),
                   out_shardings=replicated(plan.mesh))
