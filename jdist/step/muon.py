"""`--optimizer muon`: Nesterov momentum orthogonalised by Newton-Schulz for the blocks'
projection matrices, AdamW for everything else (embedding, head, norms, router, LoRA
adapters). optax's `scale_by_muon` does the momentum and the iteration (the quintic
(3.4445, -4.7750, 2.0315), 5 steps, in the momentum's dtype: float32 here, where GPU
practice is bfloat16); which leaves are matrices, and which of their axes are the matrix,
comes from the parameters' logical names.

Sharding: layers and experts are batch axes (vmapped), each matrix orthogonalised whole.
Before the momentum, the gradient of a matrix is laid out over its layers (and experts):
their axes take the mesh's devices (`owner_spec`), so each device holds whole matrices of
a few layers and orthogonalises those alone; the jit's output shardings then move state
and update back to the plan's layout. One all-to-all each way, instead of what XLA does
with a matrix sharded over fsdp or tensor (gather it in every product of every iteration:
about 10x the momentum's bytes per step, and all layers' gathered temporaries at once:
docs/muon.md). Sharding constraints change no value: the result is one device's.
"""

from __future__ import annotations

import math

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers, scale_by_muon
from optax.transforms import MaskedNode

from jdist.spmd import axes as ax

NS_COEFFS, NS_STEPS, BETA = (3.4445, -4.7750, 2.0315), 5, 0.95
# Update RMS matched to AdamW's (~0.2): scale by 0.2 * sqrt(max(fan_in, fan_out)) (Liu et
# al., "Muon is Scalable for LLM Training", arXiv 2502.16982), so --lr and --weight-decay
# mean the same for both optimizers.
RMS = 0.2
_BATCH = (ax.LAYERS, ax.EXPERTS)  # one matrix per layer and per expert
_MATRIX = (ax.HEADS, ax.KV_HEADS, ax.MLP)  # with EMBED: an attention or MLP projection


def dimension_numbers(names: tuple) -> MuonDimensionNumbers | None:
    """The matrix axes of a parameter with these logical names, or None (AdamW). The embed
    axis is one side, the rest of the non-batch axes the other: wq [embed | heads,
    head_dim], wo [heads, head_dim | embed], w_up [embed | mlp]."""
    if ax.EMBED not in names or ax.LORA_RANK in names or not set(_MATRIX) & set(names):
        return None
    rest = [i for i, n in enumerate(names) if n not in _BATCH]
    embed = names.index(ax.EMBED)
    other = tuple(i for i in rest if i != embed)
    return MuonDimensionNumbers((embed,), other) if rest[0] == embed else \
        MuonDimensionNumbers(other, (embed,))


def labels(names: dict):
    """`params -> tree of 'muon' | 'adamw'` (`names`: logical names per parameter, the model's
    tree; a trained subset of it is looked up by path)."""
    by_path = names_by_path(names)
    return lambda params: jax.tree_util.tree_map_with_path(
        lambda p, _: "muon" if dimension_numbers(by_path[path_key(p)]) else "adamw", params)


def muon(schedule: optax.Schedule, weight_decay: float, names: dict,
         adamw: optax.GradientTransformation, mesh=None) -> optax.GradientTransformation:
    """Muon on the matrices (decoupled weight decay, as AdamW's), `adamw` on the rest; with
    a `mesh`, each matrix orthogonalised on the devices that own its layer."""
    dims = _dims(names_by_path(names))
    matrices = optax.chain(
        _owned(scale_by_muon(NS_COEFFS, NS_STEPS, BETA, nesterov=True,
                             weight_dimension_numbers=dims), mesh, dims),
        _scale_by_shape(dims), optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": matrices, "adamw": adamw}, labels(names))


def matrix_shape(shape: tuple, dims: MuonDimensionNumbers) -> tuple[int, int, int]:
    """(matrices, rows, cols) of a leaf of `shape` as Muon sees it."""
    rows = math.prod(shape[i] for i in dims.reduction_axis)
    cols = math.prod(shape[i] for i in dims.output_axis)
    return math.prod(shape) // (rows * cols), rows, cols


def owner_axes(shape: tuple, dims: MuonDimensionNumbers, mesh_shape: dict) -> list:
    """The layout that gives each device whole matrices: the mesh's axes (in order, those
    of more than one device) over the batch axes (layers, then experts) while they divide
    them; the matrix axes unsplit. Axes left over replicate (a device repeats a matrix).
    Per array axis, a tuple of mesh axes or None."""
    free = [a for a in mesh_shape if mesh_shape[a] > 1]
    spec: list = [None] * len(shape)
    matrix = set(dims.reduction_axis) | set(dims.output_axis)
    for i in (i for i in range(len(shape)) if i not in matrix):
        taken, size = [], 1
        while free and shape[i] % (size * mesh_shape[free[0]]) == 0:
            size *= mesh_shape[free[0]]
            taken.append(free.pop(0))
        spec[i] = tuple(taken) or None
    return spec


def _owned(inner: optax.GradientTransformation, mesh, dims) -> optax.GradientTransformation:
    """`inner` (optax's Muon) on gradients, momentum and update laid out by `owner_axes`:
    all three, or XLA keeps the momentum's sum in the state's layout and partitions the
    iteration again (nothing without a mesh)."""
    def update(updates, state, params=None):
        if mesh is None:
            return inner.update(updates, state, params)
        own = lambda tree: jax.tree.map(lambda u, d: _own(u, d, mesh), tree, dims(tree),
                                        is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        updates, state = inner.update(own(updates), state._replace(mu=own(state.mu)), params)
        return own(updates), state._replace(mu=own(state.mu))
    return optax.GradientTransformation(inner.init, update)


def _own(u, dims, mesh):
    """`u` laid out by `owner_axes`; as it is when no device count divides its layers (XLA
    then partitions each product, see the module's docstring)."""
    spec = owner_axes(u.shape, dims, dict(mesh.shape))
    if not any(spec):
        return u
    return jax.lax.with_sharding_constraint(u, NamedSharding(mesh, PartitionSpec(*spec)))


def _scale_by_shape(dims) -> optax.GradientTransformation:
    def update(updates, state, params=None):
        scale = lambda u, d: u * (RMS * math.sqrt(max(matrix_shape(u.shape, d)[1:])))
        return jax.tree.map(scale, updates, dims(updates),
                            is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state
    return optax.GradientTransformation(optax.init_empty_state, update)


def _dims(by_path: dict):
    """The optax callable: the masked tree (MaskedNode where AdamW) -> dimension numbers."""
    def one(path, x):
        return x if isinstance(x, MaskedNode) else dimension_numbers(by_path[path_key(path)])
    return lambda tree: jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, MaskedNode))


def names_by_path(names: dict) -> dict:
    leaves = jax.tree_util.tree_leaves_with_path(names, is_leaf=lambda x: isinstance(x, tuple))
    return {path_key(p): n for p, n in leaves}


def path_key(path) -> str:
    return jax.tree_util.keystr(path)

