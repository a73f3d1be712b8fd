"""Grouped matmuls over expert-sorted rows: a dropless MoE's expert compute at the routed FLOPs.

Each expert's assignments are laid out contiguously, its group padded to whole blocks of
`block` rows, so every block belongs to one expert. One matmul per block, with the weights of
that block's expert, then runs (routed rows + at most one partial block per expert) x d x f,
where a buffer per expert with room for every token runs E/k times the routed FLOPs.

Why not `jax.lax.ragged_dot`: the GPU compiler (H100 target, jax 0.10.2 and 0.12) lowers it
to a dense matmul over every group, E times the routed FLOPs (benchmarks/expert_matmuls.py;
docs/measurements.md#expert-matmuls), and its Pallas-Triton lowering is missing from jax 0.10.2
and gone in 0.12. The blocks run in a loop, `chunk` blocks at a time, so only a few experts'
weights are gathered at once; a custom VJP keeps the backward from saving them per iteration.
Or (`--expert-matmul kernel`) each projection is one Pallas kernel over all the blocks
(`models.grouped_kernel`), on the same layout.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdist.models import grouped_kernel
from jdist.models.precision import accumulator
from jdist.spmd.varying import alike, varying, vma, zeros

GATHER_BYTES = 64 * 2**20  # weights gathered per loop iteration (bounds the chunk)
CHUNK_ROWS = 512           # rows per loop iteration when the weights are small


def block_rows(assignments: int, n_experts: int, least: int = 8) -> int:
    """Rows per block: the largest power of two in `least`..128 whose padding (at most one
    partial block per expert) stays within an eighth of the routed rows."""
    block = least
    while block < 128 and n_experts * block * 2 * 8 <= assignments:
        block *= 2
    return block


def chunk_blocks(block: int, weight_bytes: int) -> int:
    """Blocks per loop iteration: CHUNK_ROWS rows, or fewer where their weights are large."""
    return max(1, min(CHUNK_ROWS // block, GATHER_BYTES // max(1, weight_bytes)))


class Blocks(NamedTuple):
    """The static shape of the blocked buffer: n_blocks of `block` rows, `chunk` per loop."""
    n_blocks: int
    block: int
    chunk: int


def blocks_for(assignments: int, n_experts: int, weight_bytes: int, least: int = 8) -> Blocks:
    """The block count is the static bound sum_e ceil(n_e / block) <= (N + E (block - 1)) /
    block, whatever the routing, rounded up to whole chunks of (nearly) the largest size.
    `least`: the smallest block (the kernels' tiles: `models.grouped_kernel.MIN_TILE`)."""
    block = block_rows(assignments, n_experts, least)
    bound = (assignments + n_experts * (block - 1)) // block
    loops = -(-bound // chunk_blocks(block, weight_bytes))
    chunk = -(-bound // loops)  # as even as the loop count allows: < `loops` blocks over
    return Blocks(loops * chunk, block, chunk)


class Layout(NamedTuple):
    rows: jax.Array          # [N] each assignment's row in the blocked buffer
    block_expert: jax.Array  # [n_blocks] the expert whose weights each block uses
    expert_blocks: tuple     # ([E] first block, [E] block count) of each expert's group


def layout(experts: jax.Array, n_experts: int, shape: Blocks) -> Layout:
    """Place N assignments (expert ids [N]) in expert order, each expert's group padded to
    whole blocks."""
    n, block = experts.shape[0], shape.block
    counts = jnp.zeros(n_experts, jnp.int32).at[experts].add(1)
    blocks = (counts + block - 1) // block
    order = jnp.argsort(experts, stable=True)
    ranked = experts[order]
    rank = jnp.arange(n, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[ranked]
    first_row = (jnp.cumsum(blocks) - blocks) * block
    rows = jnp.zeros(n, jnp.int32).at[order].set(first_row[ranked] + rank)
    block_expert = jnp.searchsorted(jnp.cumsum(blocks), jnp.arange(shape.n_blocks),
                                    side="right")
    return Layout(rows, jnp.minimum(block_expert, n_experts - 1).astype(jnp.int32),
                  (jnp.cumsum(blocks) - blocks, blocks))


def _chunks(a: jax.Array, chunk: int) -> jax.Array:
    return a.reshape(a.shape[0] // chunk, chunk, *a.shape[1:])


def _blockwise(x, w, ids, chunk: int, spec: str, dot=jnp.einsum, after=None) -> jax.Array:
    """x [n_blocks, block, .] against the weights w[ids] of each block, `chunk` at a time,
    by `dot(spec, x, w)`; `after`: the output's buffer is made once this value is."""
    xs, ids = _chunks(x, chunk), _chunks(ids, chunk)
    if after is None:
        _, y = jax.lax.scan(lambda _, a: (None, dot(spec, a[0], w[a[1]])), None, (xs, ids))
        return y.reshape(-1, *y.shape[2:])
    # A scan's stacked output starts as zeros that depend on nothing, which XLA makes at
    # the top of the step, live through the whole forward (H100 compiler, jax 0.10.2:
    # eight [85, 8, 64, 2048] input gradients of qwen3-30b-a3b dp=2,ep=2,tp=4, 1.33 GiB).
    one = jax.eval_shape(lambda a, b: dot(spec, a, b), xs[0], w[ids[0]])
    start, _ = jax.lax.optimization_barrier(
        (zeros((xs.shape[0], *one.shape), one.dtype, like=after), after))
    y = jax.lax.fori_loop(0, xs.shape[0], lambda i, y: jax.lax.dynamic_update_index_in_dim(
        y, dot(spec, xs[i], w[ids[i]]), i, 0), start)
    return y.reshape(-1, *y.shape[2:])


def gmm(x: jax.Array, w: jax.Array, block_expert: jax.Array, chunk: int, fp8=None) -> jax.Array:
    """x [n_blocks, block, d] @ w[block_expert] ([E, d, f]) -> [n_blocks, block, f].
    `fp8`: a `jdist.quant.fp8.ExpertDot` for the forward and input-gradient matmuls, or None."""
    return _gmm(*alike(x, w), block_expert, chunk, fp8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x, w, block_expert, chunk, fp8):
    return _blockwise(x, w, block_expert, chunk, "gbd,gdf->gbf",
                      fp8.forward if fp8 else jnp.einsum)


def _gmm_fwd(x, w, block_expert, chunk, fp8):
    return _gmm(x, w, block_expert, chunk, fp8), (x, w, block_expert)


def _gmm_bwd(chunk, fp8, res, g):
    x, w, block_expert = res
    dx = _blockwise(g, w, block_expert, chunk, "gbf,gdf->gbd",
                    fp8.input_grad if fp8 else jnp.einsum, after=g)

    def weight_grad(dw, xs):  # float32 sums (or wider): a block's share must not round away
        xc, gc, ic = xs
        part = jnp.einsum("gbd,gbf->gdf", xc, gc, preferred_element_type=dw.dtype)
        return dw.at[ic].add(part), None

    # The sums' zeros are made once g is (an optimization barrier): zeros that depend on
    # nothing are made together, sixteen f32 [32, 7168, 2048] in one fusion of DeepSeek-V3's
    # entry computation (H100 compiler, jax 0.10.2, fsdp=8,ep=8, --remat full: its peak
    # 465.99 -> 448.49 GiB per device; the 16-expert ep=4 step 905.4 -> 904.7 MiB).
    start, _ = jax.lax.optimization_barrier((zeros(w.shape, accumulator(x, g), like=g), g))
    dw, _ = jax.lax.scan(weight_grad, start,
                         (_chunks(x, chunk), _chunks(g, chunk), _chunks(block_expert, chunk)))
    return dx, dw.astype(w.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_swiglu(x, experts, gate, up, down, fp8=None, kernel=None) -> jax.Array:
    """Tokens x [T, d] through their experts (ids [T, k]) -> each assignment's output
    [T, k, d]; the weights gate/up [E, d, f] and down [E, f, d] are in the compute dtype.
    `fp8`: a `jdist.quant.fp8.ExpertDots`, or None. `kernel`: a
    `models.grouped_kernel.Kernel` to run the matmuls as on-chip kernels, or None (the loop)."""
    t, k = experts.shape
    n_experts, d, f = gate.shape
    kernel = grouped_kernel.chosen(kernel, d, f, fp8)
    shape = blocks_for(t * k, n_experts, d * f * gate.dtype.itemsize,
                       grouped_kernel.MIN_TILE if kernel else 8)
    lay = layout(experts.reshape(-1), n_experts, shape)
    n_rows, chunk = shape.n_blocks * shape.block, shape.chunk
    # Which token each row holds (T: none, a padding row of zeros).
    token_of_row = jnp.full(n_rows, t, jnp.int32).at[lay.rows].set(
        jnp.arange(t * k, dtype=jnp.int32) // k)
    # Hidden units split over tensor: the tokens vary over it before the gather, so the
    # backward sums their gradient once, [T, d], not each projection's [rows, d].
    x = varying(x, vma(gate))
    rows = x.at[token_of_row].get(mode="fill", fill_value=0).reshape(-1, shape.block, d)
    if kernel:
        def matmul(h, w, _):
            return grouped_kernel.gmm(h, w, lay.block_expert, lay.expert_blocks, kernel)
    else:
        def matmul(h, w, dot):
            return gmm(h, w, lay.block_expert, chunk, dot)
    dot_in, dot_out = (fp8.grouped_in, fp8.grouped_out) if fp8 else (None, None)
    a = matmul(rows, gate, dot_in)
    b = matmul(rows, up, dot_in)
    out = matmul(jax.nn.silu(a) * b, down, dot_out).reshape(n_rows, d)
    return out[lay.rows].reshape(t, k, d)
