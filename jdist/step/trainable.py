"""Which parameters a step trains. Normally all; with LoRA (`ModelConfig.lora`) only the
adapters (`models.lora.is_adapter`): the base weights are frozen. Never the aux-loss-free
routing biases (`models.moe.ROUTER_BIAS`): the step moves them from the load
(`rebalanced`), outside the gradient and the optimizer.

A frozen parameter gets no gradient, no optimizer state and no gradient collective: the
trees that describe what is differentiated (gradient-layout primals, gradients, their
shardings, the optimizer state) hold `None` in its place, which JAX and optax treat as an
empty subtree. It still lives in the state (and is gathered in the forward) in its storage
dtype: the compute dtype for matrices, float32 for norm scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdist.models.lora import TARGETS, is_adapter
from jdist.models.moe import ROUTER_BIAS, rebalanced_bias
from jdist.models.names import in_block, is_blocks
from jdist.models.runs import moe_offset, runs
from jdist.quant import nf4
from jdist.spmd.axes import NF4_BLOCKS

NONE, NF4 = "none", "nf4"  # --quantize-base
QUANTIZATIONS = (NONE, NF4)
_PROJECTIONS = tuple(TARGETS.values())  # (module, weight) of every adaptable projection


def _none(x) -> bool:
    return x is None


def frozen_base(model) -> bool:
    """Whether the base weights are frozen (LoRA fine-tuning)."""
    return model.lora is not None


def is_router_bias(path) -> bool:
    return str(getattr(path[-1], "key", path[-1])) == ROUTER_BIAS


def is_trainable(model, path) -> bool:
    return not is_router_bias(path) and (not frozen_base(model) or is_adapter(path))


def select(model, tree):
    """`tree` (shaped like the parameters) with every frozen leaf replaced by None."""
    if not frozen_base(model) and not model.router_bias_rate:
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if is_trainable(model, path) else None, tree,
        is_leaf=lambda x: x is None or isinstance(x, nf4.Nf4))


def rebalanced(model, params: dict, loads, moved) -> dict:
    """`params` with every MoE layer's routing bias moved toward an even load by one step's
    assignments per expert `loads` [layers, E] (stored layer order), where `moved` (a
    boolean scalar: the step's gradients were finite); unchanged without the biases."""
    if not model.router_bias_rate:
        return params
    def move(block: dict, rows) -> dict:
        bias = rebalanced_bias(block["mlp"][ROUTER_BIAS], rows, model.router_bias_rate)
        return {**block, "mlp": {**block["mlp"],
                                 ROUTER_BIAS: jnp.where(moved, bias, block["mlp"][ROUTER_BIAS])}}

    params = dict(params)
    for run in (r for r in runs(model) if r.moe):  # its rows of the loads (models.runs)
        at = moe_offset(model, run)
        rows = loads[at:at + run.n_layers]
        if run.period == 1:
            params[run.key] = move(params[run.key], rows)
        else:  # a period's j-th blocks: every period-th row from j
            params[run.key] = {**params[run.key], **{
                f"layer_{j}": move(params[run.key][f"layer_{j}"], rows[j::run.period])
                for j in range(run.period)}}
    return params


def combine(part, full):
    """`full` with the leaves `part` holds (not None) taken from `part`."""
    return jax.tree.map(lambda p, f: f if p is None else p, part, full, is_leaf=_none)


def tree_map(f, part, *rest):
    """`jax.tree.map` over the leaves `part` holds; None where it holds None."""
    return jax.tree.map(lambda p, *r: None if p is None else f(p, *r), part, *rest,
                        is_leaf=_none)


def storage_dtype(model, path, leaf, compute_dtype):
    """A frozen matrix is stored in the compute dtype (it is only ever read in it); every
    trained parameter, and every vector, in float32."""
    per_layer = len(leaf.shape) - is_blocks(path[0])
    if is_trainable(model, path) or per_layer < 2:
        return leaf.dtype
    return jnp.dtype(compute_dtype)


def quantized(path, quantize: str) -> bool:
    """Whether a parameter is stored NF4-quantized (QLoRA): the frozen projection weights
    of the blocks (not norms, embeddings, the head, routers or experts)."""
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    return quantize == NF4 and is_blocks(keys[0]) and in_block(keys) in _PROJECTIONS


def storage_abstract(model, abstract: dict, compute_dtype, quantize: str = NONE,
                     double_quant: bool = False) -> dict:
    """Shapes and dtypes of the parameters as stored (`jdist.quant.nf4.Nf4` where quantized)."""
    def one(path, x):
        if quantized(path, quantize):
            return nf4.abstract(x.shape, double_quant, lead=1)
        return jax.ShapeDtypeStruct(x.shape, storage_dtype(model, path, x, compute_dtype))
    return jax.tree_util.tree_map_with_path(one, abstract)


def storage_names(names: dict, quantize: str, double_quant: bool) -> dict:
    """Logical names of the stored parameters: a quantized weight's codes and block maxima
    keep the weight's names (so they shard like it); its second-level scales and offset
    are per layer, replicated otherwise."""
    def one(path, n):
        if not quantized(path, quantize):
            return n
        return nf4.Nf4(n, n, (n[0], NF4_BLOCKS) if double_quant else None,
                       (n[0],) if double_quant else None)
    return jax.tree_util.tree_map_with_path(one, names, is_leaf=lambda x: isinstance(x, tuple))


def to_storage(model, params: dict, compute_dtype, quantize: str = NONE,
               double_quant: bool = False) -> dict:
    """Model-initialised (or loaded) float32 parameters in their storage form."""
    def one(path, x):
        if quantized(path, quantize):
            return nf4.quantize(x, double_quant, lead=1)
        return x.astype(storage_dtype(model, path, x, compute_dtype))
    return jax.tree_util.tree_map_with_path(one, params)


def prune(tree):
    """A nested dict without its None leaves (and the dicts left empty): what is saved of
    the parameters when the base is not."""
    if not isinstance(tree, dict):
        return tree
    kept = {k: prune(v) for k, v in tree.items() if v is not None}
    return {k: v for k, v in kept.items() if not (isinstance(v, dict) and not v)}


def checkpointed(model, params, save_base: bool):
    """The part of the parameters (or of a tree shaped like them) a checkpoint holds: all
    of them, or with LoRA (unless `save_base`) the adapters only."""
    return params if save_base or not frozen_base(model) else prune(select(model, params))


def with_base(adapters: dict, base: dict) -> dict:
    """`base` (a whole parameter tree) with the leaves `adapters` (a pruned one) holds."""
    return {k: with_base(adapters[k], v) if isinstance(v, dict) and k in adapters else
            adapters.get(k, v) for k, v in base.items()}
