"""The training state and its layout: create parameters and optimizer state directly in
their target shardings (no device or host ever holds the full model)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdist import axes as ax
from jdist import sharding as sh
from jdist.rules import Rules, resolve
from models import Llama, ModelConfig


class TrainState(NamedTuple):
    step: jax.Array
    params: dict  # pure nested dict of float32 arrays (the master weights)
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything that is decided before any array exists: structure, shapes, shardings."""

    model: ModelConfig
    mesh: Any
    rules: Rules
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    names: dict           # logical names of every parameter
    abstract: TrainState  # ShapeDtypeStructs
    shardings: TrainState
    batch_sharding: Any   # for [batch, length] token arrays


def build_model(cfg: ModelConfig, seed: int) -> Llama:
    return Llama(cfg, rngs=nnx.Rngs(params=seed))


def make_plan(cfg: ModelConfig, mesh, rules: Rules, tx: optax.GradientTransformation) -> Plan:
    """Shapes and shardings of the whole training state, from the model's logical names."""
    graphdef, abstract_vars = nnx.split(nnx.eval_shape(lambda: build_model(cfg, 0)))
    names = sh.logical_names(abstract_vars)
    abstract_params = nnx.to_pure_dict(abstract_vars)
    param_sh = sh.param_shardings(abstract_params, names, mesh, rules)
    state_sh = TrainState(step=sh.replicated(mesh), params=param_sh,
                          opt_state=sh.optimizer_shardings(tx, abstract_params, param_sh, mesh))
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                          opt_state=jax.eval_shape(tx.init, abstract_params))
    batch_sharding = jax.sharding.NamedSharding(mesh, resolve((ax.BATCH, ax.LENGTH), rules, mesh))
    return Plan(cfg, mesh, rules, tx, graphdef, names, abstract, state_sh, batch_sharding)


def init_state(plan: Plan, seed: int) -> TrainState:
    """Initialise inside `jit` with output shardings: each device computes only its shards."""
    def init() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(build_model(plan.model, seed)))
        return TrainState(jnp.zeros((), jnp.int32), params, plan.tx.init(params))
    return jax.jit(init, out_shardings=plan.shardings)()
