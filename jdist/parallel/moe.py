"""Expert parallelism: the MoE layer (`models.moe.moe_group`) as one `jax.shard_map`.

Each device routes its own tokens, sends every token to the device that owns its expert
with an all-to-all over the `expert` axis, runs its local experts (hidden units split over
`tensor`), and sends the results back with a second all-to-all. With
`pieces` (`--moe-overlap`) each exchange travels in pieces the GPU scheduler overlaps with
each other's expert matmuls (`OVERLAP_PIECES`). Load-balancing statistics
are summed over every axis of the kernel that splits tokens; the step sums them over the
data replicas (`jdist.models.loss`), so the auxiliary losses are the global ones whatever the mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jdist.models.grouped import blocks_for
from jdist.models.grouped_kernel import Kernel
from jdist.models.moe import (
    CAPACITY,
    DROPLESS,
    GROUPED,
    ROUTER_BIAS,
    STATS,
    capacity_of,
    even_pieces,
    local_experts,
    moe_group,
)
from jdist.parallel import kernel_mesh
from jdist.parallel.expert_rounds import round_capacity, routed_rounds
from jdist.quant.fp8 import expert_dots
from jdist.spmd import axes as ax
from jdist.spmd.rules import Rules, mesh_axes_of, resolve

# Four pieces left 12.5% of ep=8's all-to-all bytes exposed on the H100 compiler, two 50%,
# eight 25% (docs/measurements.md#expert-exchange).
OVERLAP_PIECES = 4
X_NAMES = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)
WEIGHT_NAMES = {"router": (None, None), ROUTER_BIAS: (None,), "w_gate": (ax.EXPERTS, None, ax.MLP),
                "w_up": (ax.EXPERTS, None, ax.MLP), "w_down": (ax.EXPERTS, ax.MLP, None),
                # gpt-oss's biases (models.moe.EXPERT_BIASES), split as their weights
                "router_b": (None,), "b_gate": (ax.EXPERTS, ax.MLP),
                "b_up": (ax.EXPERTS, ax.MLP), "b_down": (ax.EXPERTS, None)}


def moe_ffn(x: jax.Array, w: dict, cfg, *, mesh, rules: Rules, fp8: str = "off",
            pieces: int = 1, gmm_kernel=None):
    """x [B, S, d] -> (y [B, S, d], balance sums over the kernel's tokens): one shard_map
    over the mesh axes the rules give tokens and experts; the experts' matmuls in FP8
    unless `fp8` is off (`jdist.quant.fp8.ExpertDot`), grouped ones as `gmm_kernel`
    (`expert_kernel`); under expert parallelism each exchange in `pieces`."""
    d = x.shape[-1]
    x_spec = resolve(X_NAMES, rules, mesh)
    w_specs = {k: resolve(WEIGHT_NAMES[k], rules, mesh) for k in w}
    token_axes = mesh_axes_of(x_spec[0]) + mesh_axes_of(x_spec[1])
    ep_axes = mesh_axes_of(w_specs["w_gate"][0])
    tp_axes = mesh_axes_of(w_specs["w_gate"][2])
    n_ep = math.prod(mesh.shape[a] for a in ep_axes)
    pieces = pieces if n_ep > 1 else 1  # nothing travels: nothing to overlap
    dots = None if fp8 == "off" else expert_dots(fp8, tp_axes)
    run = functools.partial(local_experts, fp8=dots, kernel=gmm_kernel)
    if n_ep > 1 and cfg.moe_routing == GROUPED:
        def run(x, experts, w):
            n = even_pieces(x.shape[0], pieces)
            parts = zip(jnp.split(x, n), jnp.split(experts, n))
            return jnp.concatenate([routed_rounds(a, w, e, ep_axes, n_ep, dots, gmm_kernel)
                                    for a, e in parts]).reshape(*experts.shape, d)

    def kernel(x, w):
        lb, ls, _ = x.shape
        y, sums = moe_group(x.reshape(lb * ls, d), w, cfg, ep_axes, tp_axes, n_ep, run, dots,
                           pieces)
        if token_axes:
            sums = jax.lax.psum(sums, token_axes)
        return y.reshape(lb, ls, d), sums

    sums_spec = dict.fromkeys(STATS, P())
    return jax.shard_map(kernel, in_specs=(x_spec, w_specs), out_specs=(x_spec, sums_spec),
                         **kernel_mesh(mesh))(x, w)


def overlap_pieces(setting: str, mesh) -> int:
    """Pieces of each expert exchange under `--moe-overlap setting` on `mesh`: auto splits
    on NVIDIA GPUs, whose scheduler overlaps asynchronous collectives (on the CPU the
    pieces only cost ops)."""
    from jdist.runtime.target import overlap_by_default

    on = setting == "on" or (setting == "auto" and overlap_by_default(mesh))
    return OVERLAP_PIECES if on else 1


def expert_kernel(setting: str, mesh) -> Kernel | None:
    """The grouped matmuls under `--expert-matmul setting` on `mesh`: None for the loop;
    `kernel` runs them as Pallas kernels (Triton on NVIDIA GPUs, interpreted elsewhere).
    auto is the loop until the kernels have been timed on a GPU: so far they have only
    been compiled for one (docs/parallelism.md#mixture-of-experts)."""
    from jdist.runtime.target import overlap_by_default

    if setting != "kernel":
        return None
    return Kernel(interpret=not overlap_by_default(mesh), required=True)


def pieces_hide(model, mesh_shape: dict) -> bool:
    """Whether the pieces hide the exchanges on the GPU compiler: not for grouped routing
    whose tokens fsdp splits, where XLA fuses the four pieces' block gathers into one
    multi-output fusion, so every expert matmul waits for every exchange (H100 compiler,
    jax 0.10.2: fsdp=2,ep=8 75.0% -> 56.3% exposed, fsdp=2,ep=2,tp=4 62.5% -> 62.5%;
    docs/measurements.md#expert-exchange)."""
    return not (model.moe_routing == GROUPED and mesh_shape.get("fsdp", 1) > 1)


def keeps_exchanges(remat: str, model, mesh_shape: dict) -> bool:
    """Whether the checkpoint keeps what an MoE layer's exchanges delivered
    (`remat.EXPERT_EXCHANGE`): always under `selective`; under `full` only where the pieces
    hide the exchanges (`pieces_hide`), because there the backward's re-sent exchanges
    would sit beside nothing (ep=8 grouped: 18.8% exposed keeping them, 29.2% not), and
    elsewhere keeping them costs memory and hides nothing (H100 compiler, jax 0.10.2,
    DeepSeek-V3 fsdp=8,ep=8: 448.49 GiB per device keeping, 337.78 not, 100% exposed both)."""
    return remat != "full" or pieces_hide(model, mesh_shape)


def exposed_share(pieces: int) -> float:
    """The share of a step's expert all-to-all bytes with no matmul beside them on the GPU
    scheduler, each exchange in `pieces` (the planner's model, `jdist.plan.cost`). Per layer
    the forward and the backward each send 2 x pieces exchanges, one piece's beside
    another's expert matmuls; the forward's first dispatch and last combine have none, nor
    the backward's first (the combine's transpose), while its last runs beside the weight
    gradients': 3 of 4 x pieces. Under `selective` and `full` the same (the exchanges are
    kept, not sent again: `remat.EXPERT_EXCHANGE`). Against the H100 compiler, qwen3-30b-a3b
    (docs/measurements.md#expert-exchange): 1 piece 75% (measured 62.5-87.5%), 4 pieces
    18.8% (measured 12.5-18.8% on ep=8 and dp=2,ep=2,tp=4; not where fsdp splits grouped
    routing's tokens: 56.3% on fsdp=2,ep=8, 62.5% on fsdp=2,ep=2,tp=4)."""
    return 3 / (4 * pieces)


def expert_dispatch(mesh, rules: Rules, fp8: str = "off", pieces: int = 1, kernel=None):
    """`ModelContext.moe` for a step on `mesh` under `rules` (`--fp8`: `fp8`; exchanges in
    `pieces`; grouped matmuls as `kernel`)."""
    return functools.partial(moe_ffn, mesh=mesh, rules=rules, fp8=fp8, pieces=pieces,
                             gmm_kernel=kernel)


def expert_factor(model, group_tokens: float, n_ep: int, pieces: int = 1) -> float:
    """What the experts' matmuls execute over the routed FLOPs, for `group_tokens` tokens
    per device and micro-batch: the padded dropless path computes every expert over every
    token (E / k), capacity its buffers (E x capacity slots), grouped its blocked rows
    (`models.grouped`; under ep, one round of `jdist.parallel.expert_rounds`, blocked per
    piece)."""
    e, k = model.n_experts, model.top_k
    t = max(1, int(group_tokens))
    if not e:
        return 1.0
    if model.moe_routing == DROPLESS:
        return e / k
    if model.moe_routing == CAPACITY:
        return e * capacity_of(t, model, dropless=False) / (t * k)
    if n_ep == 1:
        shape = blocks_for(t * k, e, model.d_model * model.d_ff * 2)
        return shape.n_blocks * shape.block / (t * k)
    n = even_pieces(t, pieces)  # each piece's tokens in their own rounds, blocked alone
    rows = n_ep * round_capacity(t * k // n, n_ep)
    shape = blocks_for(rows, e // n_ep, model.d_model * model.d_ff * 2)
    return n * shape.n_blocks * shape.block / (t * k)
