"""Shardings of the training state: parameters from their logical names, optimizer state
mirroring its parameters, and per-device byte accounting."""

from __future__ import annotations

import math
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jdist.errors import require
from jdist.spmd import axes as ax
from jdist.spmd.rules import Rules, resolve

# Which command-line flag sets each logical dimension: errors name the fix.
DIM_FLAGS = {
    ax.HEADS: "--n-heads", ax.KV_HEADS: "--n-kv-heads", ax.MLP: "--d-ff",
    ax.VOCAB: "--vocab-size", ax.EMBED: "--d-model", ax.NORM: "--d-model",
    ax.LAYERS: "--n-layers", ax.BATCH: "--batch-size", ax.LENGTH: "--seq-len",
    ax.EXPERTS: "--n-experts",
}


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_names(state: nnx.State) -> dict:
    """Pure dict {param path: tuple of logical names} from an (abstract) nnx state."""
    def names(v: nnx.Variable) -> tuple:
        meta = v.get_metadata()
        found = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
        if not found and len(v.shape):
            # Silently replicating every parameter would be far worse than stopping: this
            # happens if flax renames its sharding metadata key again.
            raise RuntimeError(f"parameter of shape {v.shape} has no logical axis names in its "
                               f"metadata ({sorted(meta)}); jdist reads 'out_sharding'")
        return tuple(found) if found else ()
    return nnx.to_pure_dict(jax.tree.map(names, state, is_leaf=_is_variable))


def check_divisible(shape: tuple[int, ...], names: tuple, mesh, rules: Rules, what: str) -> None:
    """Every dimension must split evenly over the mesh axes its logical name resolves to."""
    spec = resolve(names, rules, mesh)
    for size, name, part in zip(shape, names, spec):
        if part is None:
            continue
        mesh_axes = (part,) if isinstance(part, str) else part
        ways = math.prod(mesh.shape[a] for a in mesh_axes)
        flag = DIM_FLAGS.get(name, "the model shape")
        require(size % ways == 0,
                f"{what}: {name} dimension {size} is not divisible by "
                f"{'x'.join(mesh_axes)}={ways}, which the rules shard it over; "
                f"change {flag} to a multiple of {ways} or use a smaller "
                f"{'/'.join(mesh_axes)} axis")


def check_model_fits(model, mesh, rules: Rules) -> None:
    """Model dimensions that the rules shard must divide evenly; checked in the order a user
    thinks about them (heads before kv heads), before any parameter is looked at."""
    for name, size in ((ax.HEADS, model.n_heads), (ax.KV_HEADS, model.n_kv_heads),
                       (ax.MLP, model.d_ff), (ax.VOCAB, model.vocab_size),
                       (ax.EMBED, model.d_model), (ax.EXPERTS, model.n_experts)):
        if size:
            check_divisible((size,), (name,), mesh, rules, "model")


def param_shardings(abstract_params: dict, names: dict, mesh, rules: Rules) -> dict:
    """NamedSharding for every parameter, after checking each splits evenly."""
    def one(path, leaf, leaf_names):
        check_divisible(leaf.shape, leaf_names, mesh, rules, f"parameter {path_str(path)}")
        return NamedSharding(mesh, resolve(leaf_names, rules, mesh))
    return jax.tree_util.tree_map_with_path(one, abstract_params, names,
                                            is_leaf=lambda x: isinstance(x, tuple))


def optimizer_shardings(tx: optax.GradientTransformation, abstract_params: dict,
                        shardings: dict, mesh) -> Any:
    """Optimizer state leaves shaped like a parameter take that parameter's sharding: a
    leaf whose path ends in a parameter's path, with its shape (a moment of it, also inside
    the masked halves of a partitioned optimizer such as Muon's, which optax's
    `tree_map_params` cannot follow); every other leaf (counts, constants) is replicated."""
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path = {jax.tree_util.keystr(p): (x.shape, s) for (p, x), s in
               zip(jax.tree_util.tree_leaves_with_path(abstract_params),
                   jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding)))}

    def one(path, leaf):
        for i in range(len(path)):
            shape, sharding = by_path.get(jax.tree_util.keystr(path[i:]), (None, None))
            if shape == leaf.shape:
                return sharding
        return replicated
    return jax.tree_util.tree_map_with_path(one, abstract_opt)


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def per_device_bytes(abstract_tree: Any, shardings: Any, itemsize: int | None = None) -> int:
    """Bytes one device holds of `abstract_tree` laid out as `shardings` (at `itemsize`
    bytes per element instead of each leaf's own, if given)."""
    leaves = jax.tree.leaves(abstract_tree)
    sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return sum(math.prod(s.shard_shape(x.shape)) * (itemsize or x.dtype.itemsize)
               for x, s in zip(leaves, sh))


def path_str(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)

