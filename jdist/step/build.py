"""The jitted training and evaluation steps: gradients of the objective (`jdist.models.loss`) by
the one gradient path (`jdist.step.grads`, or the pipeline schedule when the mesh has
stages), then the AdamW update on the sharded state."""

from __future__ import annotations

from typing import TypedDict

import jax
import jax.numpy as jnp
import optax

from jdist.models.loss import Objective, StepResult
from jdist.parallel import collective_matmul
from jdist.runtime import target
from jdist.spmd import axes as ax
from jdist.spmd.sharding import replicated
from jdist.step import device_walk, host_update, trainable
from jdist.step.grads import step_eval, step_grads
from jdist.step.optim import updates_applied
from jdist.step.pipelined import pipeline_eval, pipeline_grads
from jdist.step.state import Plan, TrainState


class Batch(TypedDict):
    """A global batch of token windows, laid out as `Plan.batch_sharding`."""

    inputs: jax.Array   # [batch, length] int32 token ids
    targets: jax.Array  # [batch, length] next-token ids; jdist.models.loss.IGNORE where not counted


def gradients(plan: Plan, params: dict, batch: Batch) -> StepResult:
    """(objective, metrics, gradients laid out as `plan.grad_shardings`, per-layer expert
    loads [layers, E] for the routing biases or None) of a global batch: by the one dense
    path, or by the pipeline schedule when the mesh has stages (jdist.parallel.pipeline);
    both end here, in the objective's one `result`."""
    path = pipeline_grads if plan.pipeline is not None else step_grads
    terms, grads, micro = path(plan, params, batch)
    grads = jax.lax.with_sharding_constraint(grads, plan.grad_shardings)
    return Objective(plan.model).result(terms, grads, micro)


def compiler_options(plan: Plan) -> dict:
    """The compile options of `plan`'s step (`jdist.runtime.target.compiler_options`): on
    NVIDIA GPUs jdist's flags, with XLA's analytical latency estimator where it suits the step
    (`target.estimator_suits`)."""
    pipelined = plan.pipeline is not None
    runs = collective_matmul.applies(plan.compute.collective_matmul, plan.mesh, plan.rules,
                                     pipelined)
    width = plan.mesh.shape[ax.TENSOR] if runs else 0
    suits = target.estimator_suits(width, pipelined, bool(plan.model.n_experts),
                                   plan.compute.tp_halves)
    return target.compiler_options(plan.mesh, plan.compute.tp_halves, suits)


def make_train_step(plan: Plan, schedule: optax.Schedule | None = None, *,
                    return_grads: bool = False, inject_nan_at_step: int = 0):
    """The one training step: `step(state, batch) -> (state, metrics)`, jitted with the
    plan's shardings; the old state is donated so parameters and optimizer state are
    updated in place. Options:

    - `schedule`: report `lr`, the rate this step's update applies, read at the optimizer's
      own count of updates (`updates_applied`: a skipped step does not advance it);
    - `return_grads`: also return the gradients, `(state, metrics, gradients)` (the
      equivalence harness);
    - `inject_nan_at_step` N (debug, `--inject-nan-at-step`): step N (1-based, as in
      metrics.jsonl) runs its forward and backward on NaN parameters, so its loss and
      gradients are non-finite; the stored parameters are kept as they were and the
      optimizer state goes where the update puts it (the `--on-nan` policy decides next).
    `--offload disk` (`plan.on_disk`) returns a `jdist.step.disk_step.DiskStep`: the
    update reads and writes the moments' files between layers, outside any one program.
    """
    if plan.on_disk:
        from jdist.step.disk_step import DiskStep

        assert not inject_nan_at_step, "--offload disk refuses --inject-nan-at-step"
        return DiskStep(plan, gradients, schedule, return_grads)

    def step(state: TrainState, batch: Batch):
        params = state.params
        if inject_nan_at_step:
            hit = state.step == inject_nan_at_step - 1
            params = jax.tree.map(lambda p: jnp.where(hit, jnp.nan, p), params)
        loss_value, extra, grads, loads = gradients(plan, params, batch)
        # Offloaded optimizer state comes in from host memory for the update only.
        opt_state = jax.device_put(state.opt_state, plan.opt_device_shardings) \
            if plan.offload and not plan.streams else state.opt_state
        norm = host_update.norm if plan.streams else optax.tree.norm
        metrics = {"loss": loss_value, "grad_norm": norm(grads), **extra}
        if schedule is not None:
            metrics["lr"] = schedule(updates_applied(opt_state))
        trained = trainable.select(plan.model, state.params)  # frozen leaves: None
        if device_walk.applies(plan):  # --offload params, Muon: on the device by chunks
            new_trained, opt_state = device_walk.update(plan, grads, opt_state, trained,
                                                        metrics["grad_norm"])
        elif plan.streams:  # --offload params: on the host, clipped by the norm just taken
            new_trained, opt_state = host_update.update(plan.tx, grads, opt_state, trained,
                                                        metrics["grad_norm"])
        else:
            updates, opt_state = plan.tx.update(grads, opt_state, trained)
            new_trained = optax.apply_updates(trained, updates)
        new_params = trainable.combine(new_trained, state.params)
        # Aux-loss-free balancing: moved by the load, outside the optimizer; a non-finite
        # step (skipped, rolled back or stopped on) never moves it.
        new_params = trainable.rebalanced(plan.model, new_params, loads,
                                          jnp.isfinite(metrics["grad_norm"]))
        if inject_nan_at_step:
            new_params = jax.tree.map(lambda n, o: jnp.where(hit, o, n), new_params,
                                      state.params)
        new_state = TrainState(state.step + 1, new_params, opt_state)
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
