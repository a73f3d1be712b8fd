"""Which parameters a step trains. Normally all; with LoRA (`ModelConfig.lora`) only the
adapters (`models.lora.is_adapter`): the base weights are frozen.

A frozen parameter gets no gradient, no optimizer state and no gradient collective: the
trees that describe what is differentiated (gradient-layout primals, gradients, their
shardings, the optimizer state) hold `None` in its place, which JAX and optax treat as an
empty subtree. It still lives in the state (and is gathered in the forward) in its storage
dtype: the compute dtype for matrices, float32 for norm scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdist.train.layer_order import BLOCKS
from models.lora import is_adapter


def _none(x) -> bool:
    return x is None


def frozen_base(model) -> bool:
    """Whether the base weights are frozen (LoRA fine-tuning)."""
    return model.lora is not None


def is_trainable(model, path) -> bool:
    return not frozen_base(model) or is_adapter(path)


def select(model, tree):
    """`tree` (shaped like the parameters) with every frozen leaf replaced by None."""
    if not frozen_base(model):
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if is_adapter(path) else None, tree, is_leaf=_none)


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
    per_layer = len(leaf.shape) - (getattr(path[0], "key", None) == BLOCKS)
    if is_trainable(model, path) or per_layer < 2:
        return leaf.dtype
    return jnp.dtype(compute_dtype)


def storage_abstract(model, abstract: dict, compute_dtype) -> dict:
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            x.shape, storage_dtype(model, path, x, compute_dtype)), abstract)


def to_storage(model, params: dict, compute_dtype) -> dict:
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(storage_dtype(model, path, x, compute_dtype)), params)


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
