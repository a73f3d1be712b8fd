"""Where parameters meet their gradients inside the step's replica `shard_map`.

The step is manual over the replica axes (`data`, `fsdp`). There each parameter leaf has a
*stored* layout (how it lives between steps) and a *gradient* layout (how its reduced
gradient lives: the same, or sharded over `data` too from ZeRO-2). `materialize` turns the
stored local block into the full value a layer computes with, and its custom VJP turns
that value's cotangent into the reduced gradient, right where the backward produces it:

  forward   all-gather the stored block over the axes it is sharded on, in compute dtype
  backward  upcast to float32, all-reduce over the replica axes the gradient layout does
            not shard (ZeRO-0/1), reduce-scatter over those it does (ZeRO-2/3, fsdp),
            divided by the number of replicas (the batch mean)

Inside the layer loop this is one layer's gather and reduction per iteration, so the peak
is one layer's unreduced gradient and the collective overlaps the next layer's backward.
With `defer=True` the all-reduce is left out (micro-batches accumulate locally; the step
all-reduces once, `finish_reduce`).

The replica shard_map runs with `check_vma=False` (see `REPLICA_CHECK_VMA`): every
reduction over the replica axes is written here, none is inferred.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jdist.errors import require
from jdist.models.remat import GATHERED
from jdist.spmd.rules import as_candidate, mesh_axes_of

# `check_vma` of the replica shard_map (jdist.step.grads, jdist.step.pipelined). Off, for
# a jax limitation (0.10.2): with it on, autodiff's partial evaluation of a kernel shard_map
# nested inside (ring/ulysses/all-gather attention) gives the kernel's residuals out_specs
# that list the outer manual axes before its own, and Shardy rejects the program ("manual
# axis sequence after free axis fsdp"). Nothing is lost: `materialize` writes every
# reduction over the replica axes, so none has to be inferred from the types.
REPLICA_CHECK_VMA = False


def manual_part(spec, ndim: int, manual: tuple[str, ...], what: str = "") -> tuple:
    """Per dimension, the manual mesh axes of a PartitionSpec entry. They must lead the
    entry: a shard_map's in_specs can only describe manual axes as the major split."""
    out = []
    for entry in entries_of(spec, ndim):
        axes = mesh_axes_of(entry)
        lead = tuple(a for a in axes if a in manual)
        require(axes[:len(lead)] == lead,
                f"{what}: sharding {entry} puts {'/'.join(lead)} after another mesh axis; "
                f"list {'/'.join(manual)} first in the rule candidate")
        out.append(lead)
    return tuple(out)


def entries_of(spec, ndim: int) -> tuple:
    """A PartitionSpec's entry for each of `ndim` dimensions (None past its end)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def in_spec(parts: tuple):
    """The shard_map spec of per-dimension manual axes."""
    from jax.sharding import PartitionSpec
    return PartitionSpec(*(as_candidate(a) for a in parts))


@dataclasses.dataclass(frozen=True)
class Sync:
    """How one parameter leaf is gathered and its gradient reduced (static, hashable)."""

    stored: tuple       # per dim: manual axes the stored block is split over
    grad: tuple         # per dim: manual axes the gradient is split over (stored's + more)
    reduce: tuple       # manual axes the gradient is summed over whole (all-reduce)
    replicas: int       # product of the manual axis sizes: the gradient is their mean
    cast: bool          # hand the layer the compute dtype (else float32: norms, embedding)
    auto: tuple = ()    # per dim: the other mesh axes (tensor, ...) it stays split on

    @property
    def gathers(self) -> bool:
        return any(self.stored)


def make_sync(stored_spec, grad_spec, ndim: int, mesh, manual: tuple[str, ...], cast: bool,
              what: str = "") -> Sync:
    stored = manual_part(stored_spec, ndim, manual, what)
    grad = manual_part(grad_spec, ndim, manual, what)
    for s, g in zip(stored, grad):
        assert g[:len(s)] == s, (stored, grad)  # ZeRO only appends axes (jdist.spmd.zero)
    used = {a for axes in grad for a in axes}
    # The axes GSPMD partitions (tensor, ...): the collectives run on their blocks
    # (`on_shards`).
    auto = tuple(tuple(a for a in mesh_axes_of(e) if a not in manual and mesh.shape[a] > 1)
                 for e in entries_of(stored_spec, ndim))
    # A sum over a size-1 axis would still be emitted (a trivial all-reduce per layer).
    return Sync(stored, grad, tuple(a for a in manual if a not in used and mesh.shape[a] > 1),
                math.prod(mesh.shape[a] for a in manual), cast,
                auto if any(auto) else ())


def stacked(sync: Sync) -> Sync:
    """The Sync of a stack of such leaves (a leading, unsplit `layers` dimension)."""
    return dataclasses.replace(sync, stored=((),) + sync.stored, grad=((),) + sync.grad,
                               auto=((),) + sync.auto if sync.auto else ())


def to_grad_layout(stored, sync: Sync):
    """The local block of the gradient layout cut from the stored local block (ZeRO-2: each
    replica keeps its slice of the replicated parameter). This is what is differentiated."""
    for dim, (s, g) in enumerate(zip(sync.stored, sync.grad)):
        extra = g[len(s):]
        if extra:
            size = stored.shape[dim] // math.prod(_sizes(extra))
            start = jax.lax.axis_index(extra) * size
            stored = jax.lax.dynamic_slice_in_dim(stored, start, size, dim)
    return stored


def _sizes(axes):
    return [jax.lax.axis_size(a) for a in axes]


def gather(stored, sync: Sync, dtype):
    """The forward of `materialize`: the full value from the stored block."""
    def local(x):
        x = x.astype(dtype) if sync.cast else x
        for dim, axes in enumerate(sync.stored):
            if axes:
                x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
        return x
    return checkpoint_name(on_shards(local, stored, sync), GATHERED)


def reduce(ct, sync: Sync, defer: bool):
    """The backward of `materialize`: the gradient-layout block of a full cotangent."""
    def local(g):
        g = g.astype(jnp.float32)  # every gradient collective runs in float32
        if sync.reduce and not defer:
            g = jax.lax.psum(g, sync.reduce)
        for dim, axes in enumerate(sync.grad):
            if axes:
                g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        return g / sync.replicas
    return on_shards(local, ct, sync)


def on_shards(local, x, sync: Sync):
    """`local(x)` (collectives over the replica axes) run on each device's block of the
    axes GSPMD partitions (`tensor`, ...), in a shard_map manual over them too. Left to
    GSPMD, a replica collective is partitioned as if its operand were whole over those
    axes: under fsdp x tp every weight was all-gathered over `tensor` before its fsdp
    gather and then sliced, and every gradient likewise before its reduce-scatter (GPU
    compiler, jax 0.10.2; docs/measurements.md#tensor-collectives)."""
    from jax.sharding import PartitionSpec

    from jdist.parallel import manual_axes

    inside = manual_axes()  # a kernel's shard_map (the vocab loss) is manual over all
    auto = tuple(tuple(a for a in axes if a not in inside) for axes in sync.auto)
    if not any(auto):
        return local(x)
    spec = PartitionSpec(*(as_candidate(a) for a in auto))
    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=spec,
                         out_specs=spec, axis_names=frozenset(a for t in auto for a in t),
                         check_vma=False)(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def materialize(primal, stored, sync: Sync, dtype, defer: bool = False):
    """The full value a layer computes with. `primal` (the gradient-layout block, from
    `to_grad_layout` or the stored block itself) is what receives the reduced gradient;
    the forward reads only `stored`."""
    return gather(stored, sync, dtype)


def _fwd(primal, stored, sync, dtype, defer):
    return gather(stored, sync, dtype), None


def _bwd(sync, dtype, defer, _, ct):
    return reduce(ct, sync, defer), None


materialize.defvjp(_fwd, _bwd)


def finish_reduce(grad, sync: Sync):
    """The all-reduce `defer=True` left out: once per step, after accumulation."""
    return jax.lax.psum(grad, sync.reduce) if sync.reduce else grad
