"""`--optimizer muon`: Nesterov momentum orthogonalised by Newton-Schulz for the blocks'
projection matrices, AdamW for everything else (embedding, head, norms, router, LoRA
adapters). optax's `scale_by_muon` does the momentum and the iteration (the quintic
(3.4445, -4.7750, 2.0315), 5 steps, in the momentum's dtype: float32 here, where GPU
practice is bfloat16); which leaves are matrices, and which of their axes are the matrix,
comes from the parameters' logical names.

Sharding: each leaf's iteration runs under the step's jit on the leaf as it is sharded
(fsdp, tensor, expert); XLA inserts the collectives the products need, so the result is
the one-device result by construction. Layers and experts are batch axes (vmapped), so a
matrix sharded only over them is orthogonalised where it lives; a matrix sharded over
fsdp or tensor is gathered by XLA. We do not constrain the momentum to a replicated layout
first: it would gather the same bytes and keep a whole copy on every device.
"""

from __future__ import annotations

import math

import jax
import optax
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
    by_path = _by_path(names)
    return lambda params: jax.tree_util.tree_map_with_path(
        lambda p, _: "muon" if dimension_numbers(by_path[_key(p)]) else "adamw", params)


def muon(schedule: optax.Schedule, weight_decay: float, names: dict,
         adamw: optax.GradientTransformation) -> optax.GradientTransformation:
    """Muon on the matrices (decoupled weight decay, as AdamW's), `adamw` on the rest."""
    dims = _dims(_by_path(names))
    matrices = optax.chain(
        scale_by_muon(NS_COEFFS, NS_STEPS, BETA, nesterov=True, weight_dimension_numbers=dims),
        _scale_by_shape(dims), optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": matrices, "adamw": adamw}, labels(names))


def newton_schulz_flops(rows: int, cols: int) -> int:
    """FLOPs of orthogonalising one rows x cols matrix: per step, with m = min and n = max,
    A = X Xᵀ (2 m² n), A·A (2 m³) and (bA + cA²) X (2 m² n)."""
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m ** 3)


def newton_schulz_per_device(opt_state, opt_shardings, names: dict) -> float:
    """FLOPs one device spends per step orthogonalising (0 without Muon): each matrix's
    `newton_schulz_flops`, split over the devices its momentum is sharded over (XLA
    partitions the products rather than repeating them: measured on the CPU compiler within
    30% of this, `docs/muon.md`). `opt_state` abstract, `opt_shardings` its shardings."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "MuonState")
    if not found:
        return 0.0
    mu = found[0][1].mu
    shardings = optax.tree_utils.tree_get_all_with_path(opt_shardings, "MuonState")[0][1].mu
    by_path, total = _by_path(names), 0.0
    for (path, x), sharding in zip(jax.tree_util.tree_leaves_with_path(mu),
                                   jax.tree.leaves(shardings)):
        matrices, rows, cols = matrix_shape(x.shape, dimension_numbers(by_path[_key(path)]))
        shards = math.prod(x.shape) / math.prod(sharding.shard_shape(x.shape))
        total += matrices * newton_schulz_flops(rows, cols) / shards
    return total


def matrix_shape(shape: tuple, dims: MuonDimensionNumbers) -> tuple[int, int, int]:
    """(matrices, rows, cols) of a leaf of `shape` as Muon sees it."""
    rows = math.prod(shape[i] for i in dims.reduction_axis)
    cols = math.prod(shape[i] for i in dims.output_axis)
    return math.prod(shape) // (rows * cols), rows, cols


def _scale_by_shape(dims) -> optax.GradientTransformation:
    def update(updates, state, params=None):
        scale = lambda u, d: u * (RMS * math.sqrt(max(matrix_shape(u.shape, d)[1:])))
        return jax.tree.map(scale, updates, dims(updates),
                            is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state
    return optax.GradientTransformation(optax.init_empty_state, update)


def _dims(by_path: dict):
    """The optax callable: the masked tree (MaskedNode where AdamW) -> dimension numbers."""
    def one(path, x):
        return x if isinstance(x, MaskedNode) else dimension_numbers(by_path[_key(path)])
    return lambda tree: jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, MaskedNode))


def _by_path(names: dict) -> dict:
    leaves = jax.tree_util.tree_leaves_with_path(names, is_leaf=lambda x: isinstance(x, tuple))
    return {_key(p): n for p, n in leaves}


def _key(path) -> str:
    return jax.tree_util.keystr(path)

