"""The training step of `--offload disk`: one jitted program computes the loss, the
gradients and their global norm as every mode does (`jdist.step.build.gradients`), then the
update walks the layers, streaming each one's moments from their files
(`jdist.step.disk_update`). Not one jitted step: the files are read and written between the
layers' updates, by the host."""

from __future__ import annotations

import jax
import optax

from jdist.step import trainable
from jdist.step.disk_update import LayerUpdate
from jdist.step.optim import updates_applied
from jdist.step.state import TrainState


class DiskStep:
    """`step(state, batch) -> (state, metrics[, gradients])`, as `make_train_step`'s."""

    def __init__(self, plan, gradients, schedule=None, return_grads: bool = False):
        """`gradients(plan, params, batch)`: the one gradient path (`jdist.step.build`)."""
        self.plan, self.schedule, self.return_grads = plan, schedule, return_grads
        self.update = LayerUpdate(plan)

        def grads_step(params, batch):
            loss, extra, grads, loads = gradients(plan, params, batch)
            return {"loss": loss, "grad_norm": optax.tree.norm(grads), **extra}, grads, loads
        batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}
        self.grads_step = jax.jit(grads_step, in_shardings=(plan.shardings.params, batch_sh))
        self.rebalance = jax.jit(lambda params, loads, ok: trainable.rebalanced(
            plan.model, params, loads, ok), donate_argnums=0)

    def __call__(self, state: TrainState, batch):
        metrics, grads, loads = self.grads_step(state.params, batch)
        if self.schedule is not None:
            metrics["lr"] = self.schedule(updates_applied(state.opt_state))
        params, opt_state = self.update.update(state.params, grads, state.opt_state,
                                               metrics["grad_norm"])
        if loads is not None:  # aux-loss-free routing biases, after the update (as build's)
            params = self.rebalance(params, loads, jax.numpy.isfinite(metrics["grad_norm"]))
        new = TrainState(state.step + 1, params, opt_state)
        return (new, metrics, grads) if self.return_grads else (new, metrics)

    def lower(self, state: TrainState, batch):
        """The device program (gradients and norm), lowered: what a compiler sees of it."""
        return self.grads_step.lower(state.params, batch)
