"""What `--optimizer muon` costs, from the plan's shapes and shardings: Newton-Schulz FLOPs
per device (the cost model), the update's temporaries (the memory model), and the
all-to-alls of the owner layout (the traffic model). Measured in docs/muon.md."""

from __future__ import annotations

import math

import jax
import optax

from jdist.step.muon import (
    NS_STEPS,
    dimension_numbers,
    matrix_shape,
    names_by_path,
    owner_axes,
    path_key,
)


def newton_schulz_flops(rows: int, cols: int) -> int:
    """FLOPs of orthogonalising one rows x cols matrix: per step, with m = min and n = max,
    A = X Xᵀ (2 m² n), A·A (2 m³) and (bA + cA²) X (2 m² n)."""
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m ** 3)


def newton_schulz_per_device(opt_state, opt_shardings, mesh_shape: dict,
                             names: dict) -> float:
    """FLOPs one device spends per step orthogonalising (0 without Muon): each matrix's
    `newton_schulz_flops` over its owners. `opt_state` abstract, `opt_shardings` its
    shardings. Measured on the H100 compiler: 83.2 TFLOP on llama3-8b fsdp=8 (83.24
    here), 5.72 on llama3.2-1b (5.72; docs/muon.md)."""
    return sum(matrices * newton_schulz_flops(rows, cols) / owners for matrices, rows, cols,
               owners in _owned_matrices(opt_state, opt_shardings, mesh_shape, names))


def update_bytes(opt_state, opt_shardings, mesh_shape: dict, names: dict) -> int:
    """Temporaries of Muon's update per device: three float32 trees of the owned matrices
    whole (gradient, momentum, orthogonalised update). On the H100 compiler the step's
    temporaries measured 2.73x (llama3-8b fsdp=8: 8.87 GiB) and 2.85x (llama3.2-1b: 1.29
    GiB) the owned bytes; 0 without Muon."""
    return int(sum(3 * 4 * matrices * rows * cols / owners for matrices, rows, cols, owners
                   in _owned_matrices(opt_state, opt_shardings, mesh_shape, names)))


def owner_moves(opt_state, opt_shardings, mesh_shape: dict, names: dict):
    """(elements, owners, stored) per matrix leaf: the owned elements per device, the owner
    axes, and those of them that also shard its momentum in the plan's layout."""
    for x, dims, sharding in _momenta(opt_state, opt_shardings, names):
        owners = [a for axes in owner_axes(x.shape, dims, mesh_shape) if axes for a in axes]
        stored = {a for axes in sharding.spec if axes
                  for a in ((axes,) if isinstance(axes, str) else axes)}
        yield math.prod(x.shape) // math.prod(mesh_shape[a] for a in owners), tuple(owners), \
            tuple(a for a in mesh_shape if a in owners and a in stored)


def _owned_matrices(opt_state, opt_shardings, mesh_shape: dict, names: dict):
    """(matrices, rows, cols, owners) of each leaf Muon orthogonalises: owners, the devices
    `owner_axes` spreads its matrices over, or when none divides its layers, those its
    momentum is sharded over (XLA partitions the products: measured within 30%)."""
    for x, dims, sharding in _momenta(opt_state, opt_shardings, names):
        spec = owner_axes(x.shape, dims, mesh_shape)
        owners = math.prod(mesh_shape[a] for axes in spec if axes for a in axes) if any(spec) \
            else math.prod(x.shape) / math.prod(sharding.shard_shape(x.shape))
        yield (*matrix_shape(x.shape, dims), owners)


def _momenta(opt_state, opt_shardings, names: dict):
    """(abstract momentum, dimension numbers, sharding) of each matrix; none without Muon."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "MuonState")
    if not found:
        return
    shardings = optax.tree_utils.tree_get_all_with_path(opt_shardings, "MuonState")[0][1].mu
    by_path = names_by_path(names)
    for (path, x), sharding in zip(jax.tree_util.tree_leaves_with_path(found[0][1].mu),
                                   jax.tree.leaves(shardings)):
        yield x, dimension_numbers(by_path[path_key(path)]), sharding
