"""Collective matmuls: sequence parallelism's activation collectives split into a ring of
point-to-point transfers, each hidden behind the matmul of the chunk already there.

Under Megatron sequence parallelism the residual stream is split along its length over
`tensor`. A column-parallel projection (q/k/v, gate/up) needs the whole length, so GSPMD
gathers it first, and a row-parallel one (attention output, down) reduce-scatters its
partial sums after: collectives on the critical path, which XLA's scheduler can only hide
behind unrelated work (on the GPU program of 70B `fsdp=32,tp=2` SP they were 1.4 of its
2.5 TB per step, 80-99% exposed). Here each device multiplies the length chunk it holds
while the next arrives from its neighbour (`gather_matmul`), or sends the partial sum of
one chunk while it computes the next (`matmul_scatter`): n-1 transfers of one chunk, each
beside a matmul. The arithmetic per output element is the plain einsum's; the reduction
adds the n partial sums in ring order instead of the collective's.

Autodiff transposes the ring: the backward of a gather-matmul is a ring reduce-scatter of
the activation gradient, that of a matmul-scatter a ring gather, each again beside matmuls.
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


def _right(n: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)]


def _length_slice(x, chunk, size: int):
    return jax.lax.dynamic_slice_in_dim(x, chunk * size, size, axis=1)


def gather_matmul(x: jax.Array, ws: tuple, eq: str, *, mesh, axis: str, w_specs: tuple,
                  out_specs: tuple) -> tuple:
    """`tuple(einsum(eq, x, w) for w in ws)` for x [batch, length, ...] whose length is split
    over `axis`; each output has the whole length. `w_specs`/`out_specs`: how `axis` splits
    each weight and output (PartitionSpecs naming only `axis`)."""
    n = mesh.shape[axis]

    def ring(x, *ws):
        me, size = jax.lax.axis_index(axis), x.shape[1]
        outs = [None] * len(ws)
        for i in range(n):
            # Start the next transfer before this chunk's matmuls: nothing orders them.
            nxt = jax.lax.ppermute(x, axis, _right(n)) if i < n - 1 else None
            chunk = (me - i) % n  # the chunk held now came i steps from the left
            for k, w in enumerate(ws):
                y = jnp.einsum(eq, x, w)
                if outs[k] is None:
                    outs[k] = jnp.zeros((y.shape[0], size * n, *y.shape[2:]), y.dtype)
                outs[k] = jax.lax.dynamic_update_slice_in_dim(outs[k], y, chunk * size, 1)
            x = nxt
        return tuple(outs)

    x_spec = PartitionSpec(None, axis)
    return _smap(mesh, axis)(ring, in_specs=(x_spec, *w_specs),
                             out_specs=tuple(out_specs))(x, *ws)


def matmul_scatter(h: jax.Array, w: jax.Array, eq: str, *, mesh, axis: str, h_spec,
                   w_spec) -> jax.Array:
    """`einsum(eq, h, w)` [batch, length, embed], its length split over `axis`, where the
    contracted dims of h and w are split over `axis` (the partial sums reduce-scattered)."""
    n = mesh.shape[axis]

    def ring(h, w):
        me, size = jax.lax.axis_index(axis), h.shape[1] // n
        acc = None
        for i in range(n):
            # Device j adds its part of chunk j-1-i to what came from the left: after n
            # steps it holds the whole sum of chunk j.
            part = jnp.einsum(eq, _length_slice(h, (me - 1 - i) % n, size), w)
            acc = part if acc is None else acc + part
            if i < n - 1:
                acc = jax.lax.ppermute(acc, axis, _right(n))
        return acc

    return _smap(mesh, axis)(ring, in_specs=(h_spec, w_spec),
                             out_specs=PartitionSpec(None, axis))(h, w)



def applies(setting: str, mesh, rules, pipelined: bool = False, axis: str = "tensor") -> bool:
    """Whether the step runs these rings for `--collective-matmul setting`: on, or auto on
    NVIDIA GPUs, where sequence parallelism splits the residual stream's length over `axis`
    alone, outside pipeline stages. Refuses `on` where it does not apply.

    Not in a pipeline stage: its tick's `lax.switch` runs a stage's ring on that stage's
    devices only, and a `collective-permute` names no group, so on the CPU (jax 0.10.2) it
    paired with the other stages' permutes of that tick and moved the wrong chunks (as
    `ring_attention.Ring.shift` describes)."""
    from jdist import axes as ax
    from jdist.rules import mesh_axes_of, resolve
    from jdist.target import overlap_by_default

    if setting == "off" or (setting == "auto" and not overlap_by_default(mesh)):
        return False
    length = mesh_axes_of(resolve((ax.BATCH, ax.LENGTH, ax.ACT_EMBED), rules, mesh)[1])
    fits = mesh.shape[axis] > 1 and tuple(length) == (axis,) and not pipelined
    require(fits or setting == "auto", "--collective-matmul on needs --sequence-parallel with "
            f"{axis} > 1, the sequence split over no other axis (context parallelism) and "
            "no pipeline stages; drop --collective-matmul or use auto")
    return fits


def hooks(mesh, rules, axis: str = "tensor") -> dict:
    """`ModelContext.widen`/`narrow` as the rings over `axis`, each operand's split read
    from the rules by the logical names the model gives."""
    from jdist import axes as ax
    from jdist.rules import mesh_axes_of, resolve

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
