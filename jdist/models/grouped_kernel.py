"""The blocked grouped matmul (`models.grouped`) as Pallas kernels: each block meets its
expert's weights on chip, with no gathered copy of them and no loop of small XLA matmuls.

The loop path gathers each chunk's experts' weights into a buffer and runs one batched
matmul per chunk: on the H100 compiler, Qwen3-30B-A3B's experts became ~2,100 such matmuls a
step, each reading ~25 MB of weights for ~1.6 GFLOP. Here one kernel per projection reads
each block's weights straight from the [E, d, f] array, tile by tile, and consecutive blocks
of one expert (which the layout puts side by side) find them in L2.

Three kernels, all over the blocked rows [n_blocks, block, .] and each block's expert id:
  forward      y_b = x_b @ w[e_b]       grid (block, column tile), a loop over d
  input grad   dx_b = g_b @ w[e_b]^T    the same kernel on the transposed contraction
  weight grad  dw_e = sum_b x_b^T g_b   grid (expert, d tile, f tile), a loop over the
                                        expert's own blocks (a start and a count each)
Accumulation in float32 (or the wider input type). Lowered by Triton on NVIDIA GPUs
(compiles without a device; `jax.experimental.pallas.triton`), interpreted elsewhere: the
same arithmetic, slowly, for the exactness tests. Triton's dot wants every tile dimension a
power of two of at least 16 (`fits`).
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jdist.errors import require
from jdist.models.precision import accumulator
from jdist.spmd.varying import alike, vma, zeros

MIN_TILE = 16   # Triton's smallest dot dimension
TILE = 128      # output columns (and contraction depth) per program


def tile_of(n: int, most: int = TILE) -> int:
    """The largest power of two up to `most` that divides n (0 if below MIN_TILE)."""
    t = most
    while t >= MIN_TILE and n % t:
        t //= 2
    return t if t >= MIN_TILE else 0


class Kernel(NamedTuple):
    """How the grouped matmuls run as kernels: `interpret` off an NVIDIA GPU; `required`
    when the user asked for them (`--expert-matmul kernel`), so shapes they cannot run are
    an error rather than the loop."""
    interpret: bool
    required: bool


def chosen(kernel: Kernel | None, d: int, f: int, fp8=None) -> Kernel | None:
    """`kernel` where it can run weights [., d, f] (this device's share of f), else None."""
    if kernel is None:
        return None
    fits = bool(tile_of(d) and tile_of(f)) and fp8 is None
    require(fits or not kernel.required,
            f"--expert-matmul kernel needs the experts' d_model ({d}) and hidden units per "
            f"device ({f}) multiples of {MIN_TILE}, and --fp8 off; use --expert-matmul loop")
    return kernel if fits else None


def _params(interpret: bool, flops: float) -> dict:
    """The matmul FLOPs ride along in the custom call's metadata, where
    `jdist.tools.gpu_report` counts them (a Triton call's shapes do not say)."""
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as plt

    return {"compiler_params": plt.CompilerParams(num_warps=4, num_stages=3),
            "metadata": {"matmul_flops": json.dumps(int(flops))}}


class Spec(NamedTuple):
    """A kernel operand's or output's blocks: None for the whole array."""
    shape: tuple | None = None
    index: object = None  # grid ids -> block ids

    def pallas(self):
        return pl.BlockSpec(self.shape, self.index) if self.shape else pl.BlockSpec()


def _launch(body, grid, out: Spec, out_shape, dtype, specs, args, interpret: bool,
            flops: float):
    """out_shape [dtype] whose block at out.index(*ids) is body(ids, *operand refs), for
    every `ids` of `grid`. Pallas runs it on an NVIDIA GPU, or interprets it; inside a
    shard_map, whose operands vary over its axes, jax's own loop runs the same body
    (`_emulate`): Pallas's interpreter replays a kernel traced without those types on
    operands that have them, and fails ("dynamic_slice requires varying manual axes to
    match", jax 0.10.2 and 0.12)."""
    args = alike(*args)
    if interpret and vma(args[0]):
        return _emulate(body, grid, out, out_shape, dtype, specs, args)

    def kernel(*refs):
        refs[-1][...] = body(tuple(pl.program_id(i) for i in range(len(grid))), *refs[:-1])

    return pl.pallas_call(
        kernel, out_shape=_out(out_shape, dtype, args[0]), grid=grid,
        in_specs=[s.pallas() for s in specs], out_specs=out.pallas(),
        **_params(interpret, flops))(*args)


class _Ref:
    """An array read as a kernel reads its ref: `ref[e, pl.ds(start, size), :]`."""

    def __init__(self, a):
        self.a = a

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        index = () if index == (Ellipsis,) else index
        index += (slice(None),) * (self.a.ndim - len(index))
        starts, sizes = [], []
        for i, n in zip(index, self.a.shape):
            full, ranged = isinstance(i, slice), isinstance(i, pl.Slice)
            starts.append(0 if full else i.start if ranged else i)
            sizes.append(n if full else i.size if ranged else 1)
        block = jax.lax.dynamic_slice(self.a, starts, sizes)
        drop = tuple(d for d, i in enumerate(index) if not isinstance(i, (slice, pl.Slice)))
        return block.squeeze(drop) if drop else block


def _emulate(body, grid, out: Spec, out_shape, dtype, specs, args):
    """`_launch` as a jax loop over the grid (each program in turn, as Pallas interprets)."""
    import math

    def block(a, spec, ids):
        if not spec.shape:
            return _Ref(a)
        starts = [b * n for b, n in zip(spec.index(*ids), spec.shape)]
        return _Ref(jax.lax.dynamic_slice(a, starts, spec.shape))

    def program(p, result):
        ids = jnp.unravel_index(p, grid)
        tile = body(ids, *(block(a, s, ids) for a, s in zip(args, specs)))
        starts = [b * n for b, n in zip(out.index(*ids), out.shape)]
        return jax.lax.dynamic_update_slice(result, tile.astype(dtype), starts)

    result = zeros(out_shape, dtype, like=args[0])
    return jax.lax.fori_loop(0, math.prod(grid), program, result)


def _out(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A kernel's output type, varying over the manual axes `like` does (a pallas_call
    inside a shard_map must say so; jax 0.10.2 and 0.12 spell it `manual_axis_type`)."""
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=getattr(jax.typeof(like), "manual_axis_type",
                                                         None))


def _dot(a, b, acc_dtype, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=acc_dtype)


def block_matmul(x, w, block_expert, *, transpose: bool = False, interpret: bool = False):
    """x [n_blocks, block, k] against each block's expert's weights -> [n_blocks, block, n]:
    w [E, k, n] (transpose=False) or w [E, n, k] (transpose=True: x @ w[e]^T)."""
    n_blocks, block, depth = x.shape
    cols = w.shape[1] if transpose else w.shape[2]
    tn, tk = tile_of(cols), tile_of(depth)
    acc = accumulator(x, w)

    def grouped_matmul(ids, ids_ref, x_ref, w_ref):
        i, j = ids
        e = ids_ref[i]

        def step(s, total):
            xs = x_ref[0, :, pl.ds(s * tk, tk)]
            if transpose:
                ws = w_ref[e, pl.ds(j * tn, tn), pl.ds(s * tk, tk)]
            else:
                ws = w_ref[e, pl.ds(s * tk, tk), pl.ds(j * tn, tn)]
            return total + _dot(xs, ws, acc, trans_b=transpose)

        total = jax.lax.fori_loop(0, depth // tk, step, zeros((block, tn), acc, like=e))
        return total.astype(x.dtype)[None]

    return _launch(grouped_matmul, (n_blocks, cols // tn),
                   Spec((1, block, tn), lambda i, j: (i, 0, j)), (n_blocks, block, cols),
                   x.dtype, (Spec(), Spec((1, block, depth), lambda i, j: (i, 0, 0)), Spec()),
                   (block_expert, x, w), interpret, 2.0 * n_blocks * block * cols * depth)


def expert_grads(x, g, first_block, n_blocks_of, n_experts: int, *, interpret: bool = False):
    """dw [E, d, f] = sum over each expert's blocks of x_b^T g_b, in the accumulator dtype;
    x [n_blocks, block, d], g [n_blocks, block, f]; expert e's blocks are
    first_block[e] .. first_block[e] + n_blocks_of[e]."""
    _, block, d = x.shape
    f = g.shape[-1]
    td, tf = tile_of(d), tile_of(f)
    acc = accumulator(x, g)

    def grouped_weight_grad(ids, start_ref, count_ref, x_ref, g_ref):
        e, i, j = ids
        start = start_ref[e]

        def step(b, total):
            xs = x_ref[start + b, :, pl.ds(i * td, td)]
            gs = g_ref[start + b, :, pl.ds(j * tf, tf)]
            return total + _dot(xs, gs, acc, trans_a=True)

        return jax.lax.fori_loop(0, count_ref[e], step, zeros((td, tf), acc, like=start))[None]

    return _launch(grouped_weight_grad, (n_experts, d // td, f // tf),
                   Spec((1, td, tf), lambda e, i, j: (e, i, j)), (n_experts, d, f), acc,
                   (Spec(),) * 4, (first_block, n_blocks_of, x, g), interpret,
                   2.0 * x.size * f)


def gmm(x, w, block_expert, expert_blocks, kernel: Kernel) -> jax.Array:
    """x [n_blocks, block, d] @ w[block_expert] ([E, d, f]) -> [n_blocks, block, f];
    `expert_blocks`: (first block, block count) per expert [E] each, for the weight grad."""
    return _gmm(*alike(x, w), block_expert, expert_blocks, kernel.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gmm(x, w, block_expert, expert_blocks, interpret: bool):
    return block_matmul(x, w, block_expert, interpret=interpret)


def _fwd(x, w, block_expert, expert_blocks, interpret):
    return block_matmul(x, w, block_expert, interpret=interpret), (x, w, block_expert,
                                                                    expert_blocks)


def _bwd(interpret, res, g):
    x, w, block_expert, (first, count) = res
    dx = block_matmul(g, w, block_expert, transpose=True, interpret=interpret)
    dw = expert_grads(x, g, first, count, w.shape[0], interpret=interpret)
    return dx, dw.astype(w.dtype), None, None


_gmm.defvjp(_fwd, _bwd)
