"""Activation checkpointing: the names the model gives its activations, and the policies
(`--remat`) that decide which of them a block keeps for the backward pass.

Each name is spelled once, here; `models/` tags activations with these constants and the
policies below refer to the same constants, so they cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jdist.errors import ConfigError

# Matmul outputs: cheap to store relative to the FLOPs needed to recompute them.
QUERY = "query_proj"
KEY = "key_proj"
VALUE = "value_proj"
ATTENTION_OUT = "attention_out_proj"
MLP_GATE = "mlp_gate"
MLP_UP = "mlp_up"
MLP_DOWN = "mlp_down"
MATMUL_OUTPUTS = (QUERY, KEY, VALUE, ATTENTION_OUT, MLP_GATE, MLP_UP, MLP_DOWN)
# A layer's parameters as gathered/cast for compute (jdist.parallel.grad_sync): never kept
# for the backward pass, which gathers again (FSDP's just-in-time parameters).
GATHERED = "gathered_params"
# What an expert-parallel all-to-all delivered (the rows at their experts, the outputs back):
# kept by `selective` and `full`, so the backward does not send them again. Recomputed, the
# exchanges sat beside the backward's own with no matmul to hide them (ep=8 grouped, 4
# pieces: 41.7% of the all-to-all bytes exposed under `full`, docs/measurements.md#expert-exchange).
EXPERT_EXCHANGE = "expert_exchange"

_cp = jax.checkpoint_policies
POLICIES: dict[str, Callable | None] = {
    # Keep only each block's input (and an MoE layer's exchanges); recompute the block.
    "full": _cp.save_only_these_names(EXPERT_EXCHANGE),
    # Megatron-style selective: keep projections, recompute norms, softmax and the
    # attention score matrix (the O(S^2) part) and elementwise ops.
    "selective": _cp.save_only_these_names(*MATMUL_OUTPUTS, EXPERT_EXCHANGE),
    "dots_saveable": _cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": _cp.dots_with_no_batch_dims_saveable,
    "everything_saveable": _cp.everything_saveable,
    # Selective, but the kept activations wait in host memory between passes.
    "offload_selective": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=MATMUL_OUTPUTS,
        offload_src="device", offload_dst="pinned_host"),
}
NAMES = ("none", *POLICIES)


def _all_but_gathered(prim, *_, **params) -> bool:
    """Keep every value except gathered parameters: all-gather outputs and values named
    GATHERED (a name alone is not enough: the unnamed value it names would be kept)."""
    if prim.name == "all_gather":
        return False
    return not (prim.name == "name" and params.get("name") == GATHERED)


def check(name: str) -> None:
    if name not in NAMES:
        raise ConfigError(f"unknown --remat policy {name!r}; use one of {', '.join(NAMES)}")


def wrapper(name: str, keep_exchanges: bool = True) -> Callable[[Callable], Callable]:
    """Turns a block function into its checkpointed version under policy `name`. "none"
    keeps every activation but still not the gathered parameters (a full copy of the
    model per device otherwise); the other policies never name them. `keep_exchanges`
    False: `full` keeps the block input alone, and its backward sends an MoE layer's
    exchanges again (`jdist.parallel.moe.keeps_exchanges` decides)."""
    check(name)
    policy = _all_but_gathered if name == "none" else POLICIES[name]
    if name == "full" and not keep_exchanges:
        policy = _cp.nothing_saveable
    return lambda f: jax.checkpoint(f, policy=policy, prevent_cse=False)
