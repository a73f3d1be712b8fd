"""Vocabulary-parallel embedding lookup: the table stays sharded; tokens and rows move.

Inside the step's replica `shard_map` the float32 table is stored as [vocab, embed/G], its
embed dimension split over the replica axes A (fsdp, and data under ZeRO-3; G devices),
its vocab dimension possibly over `tensor` (automatic there). Rather than all-gathering
the table (1 GB in bf16 at 8B, every micro-batch), the lookup

  forward   all-gathers the token ids over A (bytes), takes each device's columns of the
            rows of all G replicas' tokens (over `tensor`: each device the rows it holds,
            summed over `tensor`), cast to the compute dtype, and all-to-alls them back so
            each replica gets its own tokens' full rows
  backward  all-to-alls the rows' cotangents the other way, in float32, and scatter-adds
            them into the local [vocab/T, embed/G] block, which is then this block's
            gradient summed over A (every replica's tokens were scattered); the other
            replica axes are reduced as `grad_sync` reduces every parameter.

Communication is activation-sized ([tokens, embed], twice), never table-sized, and the
gradient is never dense or replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jdist.parallel import CHECK_VMA, kernel_mesh
from jdist.parallel import grad_sync as gs
from jdist.parallel.grad_sync import Sync


def supports(sync: Sync) -> bool:
    """Only the embed dimension may be split over replica axes (what `jdist.spmd.zero` and the
    default rules give); otherwise the step gathers the table as any parameter."""
    return not sync.stored[0] and not sync.grad[0]


@dataclasses.dataclass(frozen=True)
class Table:
    """The stored table block as the replica shard_map sees it (static, hashable)."""

    mesh: Any
    shape: tuple[int, int]      # [vocab, embed/G] block
    vocab_axes: tuple[str, ...]  # automatic mesh axes the vocab dimension is split over

    def take(self, table, tokens):
        """Rows [n, s, embed/G] of `tokens` [n, s], from wherever over `tensor` they live."""
        if not self.vocab_axes:
            return jnp.take(table, tokens, axis=0)
        return jax.shard_map(partial(_take, self.vocab_axes), **kernel_mesh(self.mesh),
                             in_specs=(PartitionSpec(self.vocab_axes), PartitionSpec()),
                             out_specs=PartitionSpec(), check_vma=CHECK_VMA)(table, tokens)

    def scatter(self, tokens, grad):
        """The float32 block [vocab, embed/G] that rows' gradients `grad` add up to."""
        if not self.vocab_axes:
            return _scatter((), self.shape, tokens, grad)
        n = math.prod(self.mesh.shape[a] for a in self.vocab_axes)
        local = (self.shape[0] // n, self.shape[1])
        return jax.shard_map(partial(_scatter, self.vocab_axes, local), **kernel_mesh(self.mesh),
                             in_specs=(PartitionSpec(), PartitionSpec()),
                             out_specs=PartitionSpec(self.vocab_axes),
                             check_vma=CHECK_VMA)(tokens, grad)


def _take(vocab_axes, table, tokens):
    """The local vocab shard's rows (zeros for ids held elsewhere), summed over the shards."""
    local = tokens - lax.axis_index(vocab_axes) * table.shape[0]
    ok = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.where(ok, local, 0), axis=0)
    return lax.psum(jnp.where(ok[..., None], rows, 0.0), vocab_axes)


def _scatter(vocab_axes, shape, tokens, grad):
    local = tokens - (lax.axis_index(vocab_axes) * shape[0] if vocab_axes else 0)
    index = jnp.where((local >= 0) & (local < shape[0]), local, shape[0])  # past the end: dropped
    return jnp.zeros(shape, jnp.float32).at[index.reshape(-1)].add(
        grad.reshape(-1, shape[1]).astype(jnp.float32), mode="drop")


def _forward(table: Table, stored, tokens, sync: Sync, dtype):
    split = sync.stored[1]  # replica axes splitting the embed dimension
    if split:
        tokens = lax.all_gather(tokens, split, axis=0, tiled=True)
    rows = table.take(stored, tokens).astype(dtype)
    if split:  # each replica's tokens back to it, with every device's columns of their rows
        rows = lax.all_to_all(rows, split, split_axis=0, concat_axis=2, tiled=True)
    return rows, tokens


def _backward(table: Table, tokens, ct, sync: Sync, defer: bool):
    split = sync.stored[1]
    grad = ct.astype(jnp.float32)
    if split:
        grad = lax.all_to_all(grad, split, split_axis=2, concat_axis=0, tiled=True)
    grad = table.scatter(tokens, grad)  # already summed over `split`: all their tokens
    # The rest as for every parameter, over what the table's split has not summed: the
    # other replica axes, and under ZeRO-2 the axes the gradient is split further over.
    further = tuple(g[len(s):] for s, g in zip(sync.stored, sync.grad))
    return gs.reduce(grad, dataclasses.replace(sync, grad=further), defer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _lookup(primal, stored, tokens, table: Table, sync: Sync, dtype, defer: bool):
    return _forward(table, stored, tokens, sync, dtype)[0]


def _fwd(primal, stored, tokens, table, sync, dtype, defer):
    rows, all_tokens = _forward(table, stored, tokens, sync, dtype)
    return rows, all_tokens


def _bwd(table, sync, dtype, defer, all_tokens, ct):
    return _backward(table, all_tokens, ct, sync, defer), None, None


_lookup.defvjp(_fwd, _bwd)


def lookup(primal, stored, tokens, *, sync: Sync, dtype, defer: bool, mesh,
           vocab_axes: tuple[str, ...]):
    """Rows [b, s, embed] (compute dtype) of `tokens` [b, s] from the stored block of the
    float32 table; `primal` (its gradient-layout block, `grad_sync.to_grad_layout`) receives
    the reduced float32 gradient, like `grad_sync.materialize`'s."""
    table = Table(mesh, tuple(stored.shape), tuple(a for a in vocab_axes if mesh.shape[a] > 1))
    return _lookup(primal, stored, tokens, table, sync, jnp.dtype(dtype), defer)
