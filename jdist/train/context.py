"""The `ModelContext` a training step hands the model: activation constraints from the
rules, the context-parallel attention kernel, expert dispatch, per-layer parameter
handling and the remat wrapper, all for code running inside the step's `shard_map`
(whose manual axes the rules no longer mention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jdist import remat
from jdist.parallel.context import ContextParallel
from jdist.parallel.moe import expert_dispatch
from jdist.rules import Rules, constrainer, without_axis
from models.context import ModelContext


def inner_rules(rules: Rules, manual: tuple[str, ...]) -> Rules:
    """The rules for code that runs per slice of the `manual` axes (already spent)."""
    for a in manual:
        rules = without_axis(rules, a)
    return rules


def context_parallel_of(plan, manual: tuple[str, ...]) -> ContextParallel:
    return ContextParallel(plan.mesh, inner_rules(plan.rules, manual), plan.cp_strategy)


def reorder_tokens(cp: ContextParallel, x):
    """Token ids [batch, length] in the context-parallel kernel's order. Taken whole first:
    inside the step's shard_map, with two automatic axes of size > 1 (sequence and tensor),
    XLA's SPMD partitioner (jax 0.10.2) aborts on the reorder's gather split along one
    (CHECK in ExpandDeviceGroupsWithIota); ids are tiny, so gathering them costs nothing."""
    if not cp.balanced:
        return x
    return cp.reorder(jax.lax.with_sharding_constraint(x, PartitionSpec()))


def model_context(plan, manual: tuple[str, ...], layer_params: Callable | None = None,
                  layer_stream: Any = None) -> ModelContext:
    rules = inner_rules(plan.rules, manual)
    cp = ContextParallel(plan.mesh, rules, plan.cp_strategy)
    extra = {} if layer_params is None else {"layer_params": layer_params,
                                             "layer_stream": layer_stream}
    return ModelContext(
        constrain=constrainer(plan.mesh, rules),
        attention=cp.attention if cp.size > 1 else None,
        moe=expert_dispatch(plan.mesh, rules) if plan.model.n_experts else None,
        remat_layer=remat.wrapper(plan.remat),
        compute_dtype=plan.compute_dtype, **extra)
