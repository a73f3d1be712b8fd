"""Reorder a stage-sharded layer stack with permutes between stages, never gathering it.

`new[i] = old[change[i]]` along a layer axis that `stage` splits into contiguous runs of n
layers. Each stage sends n layers and receives n, so the moves form an n-regular bipartite
multigraph between stages, which splits into n perfect matchings (König): n rounds, each a
single `ppermute` in which every stage sends one layer and receives one. A device holds
its own n layers twice at most, whatever the model size. (A `jnp.take` on the sharded axis
would make GSPMD all-gather the whole stack onto every stage.)
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jdist.parallel import CHECK_VMA
from jdist.spmd import axes as ax

Round = tuple[list[tuple[int, int]], list[int], list[int]]  # (perm, send slot, receive slot)


def rounds(change: np.ndarray, stages: int) -> list[Round]:
    """The moves of `change`, as n rounds of (stage -> stage permutation, local layer each
    stage sends, local slot each stage receives into)."""
    n = len(change) // stages
    moves = collections.defaultdict(list)  # (from stage, to stage) -> [(from slot, to slot)]
    for i, j in enumerate(np.asarray(change).tolist()):
        moves[(j // n, i // n)].append((j % n, i % n))
    out = []
    for _ in range(n):
        match = _perfect_matching(stages, moves)
        send, receive = [0] * stages, [0] * stages
        for a, b in match.items():
            send[a], receive[b] = moves[(a, b)].pop()
            if not moves[(a, b)]:
                del moves[(a, b)]
        out.append(([(a, match[a]) for a in range(stages)], send, receive))
    return out


def _perfect_matching(stages: int, moves: dict) -> dict[int, int]:
    """Sender -> receiver, every stage once on each side (Kuhn's augmenting paths)."""
    owner: dict[int, int] = {}  # receiver -> sender

    def augment(a: int, seen: set) -> bool:
        for b in range(stages):
            if (a, b) in moves and b not in seen:
                seen.add(b)
                if b not in owner or augment(owner[b], seen):
                    owner[b] = a
                    return True
        return False

    for a in range(stages):
        if not augment(a, set()):
            raise AssertionError("layer moves are not regular; not a permutation?")
    return {a: b for b, a in owner.items()}


def shuffle(x: jax.Array, change: np.ndarray, mesh) -> jax.Array:
    """`x` [layers, ...] (layers split over `stage`, other dimensions as they are) with
    `x[change]` laid out the same way, moved by permutes."""
    plan = rounds(change, mesh.shape[ax.STAGE])
    tables = [(perm, jnp.asarray(send), jnp.asarray(receive)) for perm, send, receive in plan]

    def local(block, stage):  # this stage's n layers, and its index
        me = stage[0]
        out = jnp.zeros_like(block)
        for perm, send, receive in tables:
            arrived = jax.lax.ppermute(block[send[me]], ax.STAGE, perm)
            out = jax.lax.dynamic_update_index_in_dim(out, arrived, receive[me], 0)
        return out

    # The stage index comes in as data: `axis_index` lowers to a partition id, which XLA's
    # partitioner rejects here ("PartitionId ... ambiguous") when other axes stay automatic.
    spec = PartitionSpec(ax.STAGE)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                         axis_names=frozenset({ax.STAGE}), check_vma=CHECK_VMA)(
        x, jnp.arange(mesh.shape[ax.STAGE]))
