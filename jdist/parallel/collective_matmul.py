"""Collective matmuls: sequence parallelism's activation collectives split into
point-to-point transfers of length chunks, each beside the matmul of a chunk already there.

Under Megatron sequence parallelism the residual stream is split along its length over
`tensor`. A column-parallel projection (q/k/v, gate/up) needs the whole length, so GSPMD
gathers it first, and a row-parallel one (attention output, down) reduce-scatters its
partial sums after: collectives on the critical path, which XLA's scheduler can only hide
behind unrelated work (most of a 70B SP step's collective bytes, mostly exposed:
docs/measurements.md#tensor-collectives). Here each device multiplies the length chunk it holds
while the others' arrive, each straight from its owner (`gather_matmul`), or sends the
partial sum of each chunk straight to its owner while it computes the next
(`matmul_scatter`): n-1 transfers of one chunk, none waiting for another, each beside a
matmul. The arithmetic per output element is the plain einsum's; the reduction
adds the n partial sums in its own order instead of the collective's.

Autodiff transposes the transfers: the backward of a gather-matmul scatters the
activation gradient's partial sums, that of a matmul-scatter gathers, each again beside
matmuls.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jdist.errors import require
from jdist.parallel import CHECK_VMA, manual_axes


def _smap(mesh, axis: str):
    # Manual over `axis` only; the other axes stay with GSPMD (nested in the step's shard_map
    # over the replica axes, the current abstract mesh names them).
    context = jax.sharding.get_abstract_mesh()
    return partial(jax.shard_map, mesh=context if manual_axes() else mesh,
                   axis_names=frozenset({axis}), check_vma=CHECK_VMA)


def _shift(x, axis: str, n: int, by: int):
    """x from the device `by` places to the left (device j sends to j + by)."""
    return jax.lax.ppermute(x, axis, [(j, (j + by) % n) for j in range(n)])


def _apart(x, w):
    """`w`, as a value XLA cannot tell is the same for each chunk: its GPU dot merger joins
    dots that share an operand back into one over the whole length (70B tp=8: the q/k/v
    projections ran as one [16384, 1024] gemm after every transfer, jax 0.10.2). The
    barrier ties the weight to chunk `x`; it moves no data."""
    return jax.lax.optimization_barrier((x, w))[1]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_dot(eq: str, x, w):
    """`einsum(eq, x, w)` on one chunk, kept apart from the other chunks' (`_apart`) in the
    forward and in the backward. Its residual is `w` itself: the barrier's outputs, one per
    chunk, would each be saved for the backward, n copies of every weight
    (docs/measurements.md#tensor-collectives)."""
    return jnp.einsum(eq, x, _apart(x, w))


def _chunk_dot_fwd(eq, x, w):
    return _chunk_dot(eq, x, w), (x, w)


def _chunk_dot_bwd(eq, residuals, g):
    x, w = residuals
    _, pull = jax.vjp(partial(jnp.einsum, eq), x, _apart(g, w))
    return pull(g)


_chunk_dot.defvjp(_chunk_dot_fwd, _chunk_dot_bwd)


def _roll_length(x, chunks, size: int):
    """x with its length rolled by `chunks` (traced) chunks of `size`: one dynamic slice, so
    every chunk after it is a static slice (jax 0.10.2: per-chunk dynamic slices were fused
    into kernels that ptxas was slow to compile, docs/measurements.md#tensor-collectives)."""
    return jnp.roll(x, chunks * size, axis=1)


def _gathered_dots(eq: str, axis: str, n: int, x, ws: tuple) -> tuple:
    me, size = jax.lax.axis_index(axis), x.shape[1]
    # Chunk me + by comes straight from its owner, so no transfer waits for another and
    # the scheduler can run each beside the matmuls of the chunks already here.
    held = [x] + [_shift(x, axis, n, -by) for by in range(1, n)]
    ys = [[_chunk_dot(eq, chunk, w) for chunk in held] for w in ws]
    return tuple(_roll_length(jnp.concatenate(y, axis=1), me, size) for y in ys)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gather_dots(eq: str, axis: str, n: int, x, ws: tuple) -> tuple:
    """`_gathered_dots`, whose backward gathers the chunks again beside the weight-gradient
    matmuls: autodiff would save all n chunks (the whole length) for them where the plain
    step saves the shard (docs/measurements.md#tensor-collectives)."""
    return _gathered_dots(eq, axis, n, x, ws)


def _gather_dots_fwd(eq, axis, n, x, ws):
    return _gathered_dots(eq, axis, n, x, ws), (x, ws)


def _gather_dots_bwd(eq, axis, n, residuals, gs):
    _, pull = jax.vjp(partial(_gathered_dots, eq, axis, n), *residuals)
    return pull(gs)


_gather_dots.defvjp(_gather_dots_fwd, _gather_dots_bwd)


def gather_matmul(x: jax.Array, ws: tuple, eq: str, *, mesh, axis: str, w_specs: tuple,
                  out_specs: tuple) -> tuple:
    """`tuple(einsum(eq, x, w) for w in ws)` for x [batch, length, ...] whose length is split
    over `axis`; each output has the whole length. `w_specs`/`out_specs`: how `axis` splits
    each weight and output (PartitionSpecs naming only `axis`)."""
    run = lambda x, *ws: _gather_dots(eq, axis, mesh.shape[axis], x, ws)
    x_spec = PartitionSpec(None, axis)
    return _smap(mesh, axis)(run, in_specs=(x_spec, *w_specs),
                             out_specs=tuple(out_specs))(x, *ws)


def matmul_scatter(h: jax.Array, w: jax.Array, eq: str, *, mesh, axis: str, h_spec,
                   w_spec) -> jax.Array:
    """`einsum(eq, h, w)` [batch, length, embed], its length split over `axis`, where the
    contracted dims of h and w are split over `axis` (the partial sums reduce-scattered)."""
    n = mesh.shape[axis]

    def run(h, w):
        me, size = jax.lax.axis_index(axis), h.shape[1] // n
        h = _roll_length(h, -me, size)  # chunk me + by at position by
        part = lambda by: _chunk_dot(eq, h[:, by * size:(by + 1) * size], w)
        # Each device sends its partial sum of chunk j straight to device j, which adds
        # the n partials of its own chunk (its own first, then by distance to the left).
        total = part(0)
        for by in range(1, n):
            total = total + _shift(part(by), axis, n, by)
        return total

    return _smap(mesh, axis)(run, in_specs=(h_spec, w_spec),
                             out_specs=PartitionSpec(None, axis))(h, w)


def applies(setting: str, mesh, rules, pipelined: bool = False, axis: str = "tensor") -> bool:
    """Whether the step runs these collective matmuls for `--collective-matmul setting`: on,
    or auto on NVIDIA GPUs, where sequence parallelism splits the residual stream's length
    over `axis` alone, outside pipeline stages. Refuses `on` where it does not apply.

    Not in a pipeline stage: its tick's `lax.switch` runs a stage's transfers on that stage's
    devices only, and a `collective-permute` names no group, so on the CPU (jax 0.10.2) it
    paired with the other stages' permutes of that tick and moved the wrong chunks (as
    `ring_attention.Ring.shift` describes)."""
    from jdist.runtime.target import overlap_by_default
    from jdist.spmd import axes as ax
    from jdist.spmd.rules import mesh_axes_of, resolve

    if setting == "off" or (setting == "auto" and not overlap_by_default(mesh)):
        return False
    length = mesh_axes_of(resolve((ax.BATCH, ax.LENGTH, ax.ACT_EMBED), rules, mesh)[1])
    fits = mesh.shape[axis] > 1 and tuple(length) == (axis,) and not pipelined
    require(fits or setting == "auto", "--collective-matmul on needs --sequence-parallel with "
            f"{axis} > 1, the sequence split over no other axis (context parallelism) and "
            "no pipeline stages; drop --collective-matmul or use auto")
    return fits


def hooks(mesh, rules, axis: str = "tensor") -> dict:
    """`ModelContext.widen`/`narrow` as collective matmuls over `axis`, each operand's split
    read from the rules by the logical names the model gives."""
    from jdist.spmd import axes as ax
    from jdist.spmd.rules import mesh_axes_of, resolve

    def split(names):  # only `axis`: the other mesh axes stay automatic
        return PartitionSpec(*(axis if axis in mesh_axes_of(e) else None
                               for e in resolve(names, rules, mesh)))

    def widen(x, ws, eq, out_names):
        w_sub, out_sub = eq.split(",")[1].split("->")
        w_specs = []
        for names in out_names:  # a weight's dims: the output's, or the contracted embed
            by_letter = dict(zip(out_sub, names))
            w_specs.append(split(tuple(by_letter.get(c, ax.EMBED) for c in w_sub)))
        return gather_matmul(x, ws, eq, mesh=mesh, axis=axis, w_specs=tuple(w_specs),
                             out_specs=tuple(map(split, out_names)))

    def narrow(h, w, eq, h_names):
        h_sub, w_sub = eq.split("->")[0].split(",")
        by_letter = dict(zip(h_sub, h_names))  # a weight's dims: h's contracted, or embed
        w_names = tuple(by_letter.get(c, ax.EMBED) for c in w_sub)
        return matmul_scatter(h, w, eq, mesh=mesh, axis=axis, h_spec=split(h_names),
                              w_spec=split(w_names))

    return {"widen": widen, "narrow": narrow}
