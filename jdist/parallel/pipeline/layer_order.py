"""Where each layer of the stacked blocks is *stored* when a pipeline interleaves.

The rule `layers -> stage` gives each stage a contiguous run of the stack. An interleaved
schedule (V virtual stages) runs chunks s, s+P, s+2P, ... on stage s (the V shape: s and
2P-1-s), so a run that kept
the model's order would move parameters to the stage that runs them, and gradients back,
every step. Instead the stack is stored permuted (`layer_order`): stage s's contiguous
shard *is* its chunks, and nothing but activations ever crosses stages.

The stored order is part of the layout, like a sharding, and is converted at the edges:
`init_state` initialises in model order and `store`s, comparisons read `to_model_order`,
checkpoints record the order they were written in (`CHECKPOINT_KEY`) and `restore_order`
converts on resume, so a checkpoint moves freely between interleaved and plain meshes.
On devices, layers move between stages by permutes (`jdist.parallel.pipeline.shuffle`): the
stack is never gathered, so a model that needs its stages to fit also fits while moving.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdist.errors import require
from jdist.models.names import BLOCKS
from jdist.models.runs import heterogeneous
from jdist.parallel.pipeline import schedule as sched
from jdist.parallel.pipeline.shuffle import shuffle
from jdist.spmd import axes as ax

CHECKPOINT_KEY = "layer_order"  # in checkpoint metadata: stored position -> model layer


def layer_order(n_layers: int, stages: int, virtual: int,
                schedule: str = sched.INTERLEAVED) -> np.ndarray:
    """Model layer index at each stored position: stage-major, then virtual chunk, so stage
    s's contiguous shard holds the chunks it runs (`schedule.chunk_index`): s, s+P, ...
    interleaved, s and 2P-1-s in the V shape (the identity for V = 1)."""
    k = n_layers // (stages * virtual)
    return np.array([sched.chunk_index(schedule, s, v, stages) * k + j
                     for s in range(stages) for v in range(virtual) for j in range(k)])


def order_of(plan) -> np.ndarray:
    """The stored layer order of a plan (the identity unless a stage runs several chunks)."""
    n = plan.model.n_layers
    # A heterogeneous stack's chunks are its runs (`models.runs`), each split in model
    # order over the stages: stored as they are.
    if plan.pipeline is None or plan.pipeline.virtual == 1 or heterogeneous(plan.model):
        return np.arange(n)
    return layer_order(n, plan.mesh.shape[ax.STAGE], plan.pipeline.virtual,
                       plan.pipeline.schedule)


def in_model_order(plan) -> bool:
    return _is_identity(order_of(plan))


def _is_identity(order) -> bool:
    return np.array_equal(order, np.arange(len(order)))


def permute(tree, order: np.ndarray):
    """Take `order` along the layer axis of every leaf under `blocks` (parameters, and the
    optimizer moments that mirror them); other leaves are unchanged."""
    if _is_identity(order):
        return tree  # not even a gather: GSPMD would all-gather the stage-sharded stack

    def leaf(path, x):
        if not _is_stack(path, x, len(order)):
            return x
        return np.take(x, order, axis=0) if isinstance(x, np.ndarray) else \
            jnp.take(x, order, axis=0)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def to_model_order(plan, tree):
    """The plan's stored order -> model order (host arrays: comparisons, exports)."""
    return permute(tree, np.argsort(order_of(plan)))


def store(plan, state, shardings):
    """A state in model order, on `shardings`, moved into the plan's stored order."""
    return _move(plan, state, shardings, order_of(plan))


def restore_order(plan, state, saved_order) -> object:
    """A state restored from a checkpoint stored in `saved_order` (None: model order),
    re-laid out in the plan's order, in place on the plan's shardings."""
    n = plan.model.n_layers
    saved = np.arange(n) if saved_order is None else np.asarray(saved_order)
    require(sorted(saved.tolist()) == list(range(n)),
            f"checkpoint metadata {CHECKPOINT_KEY} {saved.tolist()} is not an order of "
            f"{n} layers; the checkpoint's metadata was edited - restore an intact checkpoint")
    change = np.argsort(saved)[order_of(plan)]
    if _is_identity(change):
        return state
    # Moved in device memory: offloaded optimizer state comes in from the host and goes back.
    on_device = plan.device_shardings
    moved = _move(plan, jax.device_put(state, on_device), on_device, change)
    return jax.device_put(moved, plan.shardings)


def _move(plan, tree, shardings, change: np.ndarray):
    """`tree` (laid out as `shardings`) with every layer stack reordered by `change`: stacks
    split over `stage` alone move by permutes between stages (`layer_shuffle`); others
    (one stage, or also split over another axis) by a take."""
    if _is_identity(change):
        return tree
    mesh = plan.mesh

    def leaf(path, x, sharding):
        if not _is_stack(path, x, len(change)):
            return x
        if mesh.shape[ax.STAGE] > 1 and tuple(sharding.spec)[:1] == (ax.STAGE,):
            return shuffle(x, change, mesh)
        return jnp.take(x, change, axis=0)

    move = lambda t: jax.tree_util.tree_map_with_path(leaf, t, shardings)
    return jax.jit(move, out_shardings=shardings, donate_argnums=0)(tree)


def _is_stack(path, x, n_layers: int) -> bool:
    """A leaf under `blocks` (a parameter or an optimizer moment of one) with a layer axis."""
    in_blocks = any(getattr(k, "key", None) == BLOCKS for k in path)
    return in_blocks and np.ndim(x) > 0 and x.shape[0] == n_layers
