"""Which context-parallel attention a training step runs, chosen without the model naming
a mesh axis.

The step builds a `ContextParallel(mesh, rules, strategy)` and, when the rules shard the
queries' logical `length` dimension (`size > 1`), hands its `attention` to the model as
`ModelContext.attention`: the chosen `shard_map` kernel over those mesh axes.

The ring's causal load balancing stores tokens in a fixed permuted order; the step moves
tokens, targets and rotary positions into that order with `reorder`/`positions`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jdist.errors import require
from jdist.parallel.attention.all_gather import all_gather_attention
from jdist.parallel.attention.flash import check_window
from jdist.parallel.attention.load_balance import balanced_order
from jdist.parallel.attention.ring import Ring, ring_attention
from jdist.parallel.attention.ulysses import ulysses_attention
from jdist.spmd.axes import BATCH, HEAD_DIM, HEADS, KV_HEADS, LENGTH
from jdist.spmd.rules import Rules, mesh_axes_of, resolve

RING, ALL_GATHER, ULYSSES = "ring", "all_gather", "ulysses"
STRATEGIES = (RING, ALL_GATHER, ULYSSES)

Q_NAMES = (BATCH, LENGTH, HEADS, HEAD_DIM)
KV_NAMES = (BATCH, LENGTH, KV_HEADS, HEAD_DIM)



@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """A strategy bound to a mesh and rules: the layout of the sequence and the kernel."""

    mesh: Any
    rules: Rules
    strategy: str = RING

    def __post_init__(self) -> None:
        require(self.strategy in STRATEGIES,
                f"unknown context-parallel strategy {self.strategy!r}; use --cp-strategy "
                f"{', '.join(STRATEGIES)}")

    @property
    def q_spec(self) -> PartitionSpec:
        return resolve(Q_NAMES, self.rules, self.mesh)

    @property
    def kv_spec(self) -> PartitionSpec:
        return resolve(KV_NAMES, self.rules, self.mesh)

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axes the sequence of the attention inputs is split over."""
        return mesh_axes_of(self.q_spec[1])

    @property
    def size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def balanced(self) -> bool:
        """Only the ring skips masked blocks, so only it needs the balanced token order."""
        return self.strategy == RING and self.size > 1

    def positions(self, seq_len: int) -> np.ndarray:
        """Original position of each token slot along the length dimension."""
        self._check_chunks(seq_len)
        return balanced_order(seq_len, self.size) if self.balanced else np.arange(seq_len)

    def reorder(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """Move `x`'s length dimension into the layout's token order."""
        if not self.balanced:
            return x
        return jnp.take(x, self.positions(x.shape[axis]), axis=axis)

    def restore(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """Undo `reorder`."""
        if not self.balanced:
            return x
        return jnp.take(x, np.argsort(self.positions(x.shape[axis])), axis=axis)

    def check(self, n_heads: int, seq_len: int) -> None:
        """Shapes this layout cannot split: a one-line ConfigError naming the fix."""
        if self.size == 1:
            return
        n, seq = self.size, "x".join(self.axes)
        q_spec, kv_spec = self.q_spec, self.kv_spec
        require(q_spec[:3] == kv_spec[:3],
                f"context parallelism needs keys/values sharded like queries, but the rules "
                f"give heads {q_spec[2]} and kv_heads {kv_spec[2]}; give both the same rules")
        self._check_chunks(seq_len)
        if self.strategy == ULYSSES:
            tp = math.prod(self.mesh.shape[a] for a in mesh_axes_of(q_spec[2]))
            local = n_heads // tp
            require(local % n == 0,
                    f"--cp-strategy ulysses splits each device's {local} attention heads over "
                    f"{seq}={n}, which does not divide them; change --n-heads to a multiple "
                    f"of {n * tp} or use --cp-strategy ring")

    def _check_chunks(self, seq_len: int) -> None:
        n = self.size
        require(not self.balanced or seq_len % (2 * n) == 0,
                f"--seq-len {seq_len} does not split into 2 x {'x'.join(self.axes)}={n} equal "
                f"chunks, as load-balanced causal ring attention needs; change --seq-len to a "
                f"multiple of {2 * n} or use --cp-strategy all_gather")

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True,
                  segment_ids: jax.Array | None = None, window: int | None = None,
                  sinks: jax.Array | None = None) -> jax.Array:
        """q [b, S, h, d], k/v [b, S, kv, d] (and packed documents' `segment_ids` [b, S]),
        already in this layout's token order; a sliding `window` and `sinks` [h] as
        `flash_attention` takes them."""
        self.check(q.shape[2], q.shape[1])  # the same errors for Python callers as for the CLI
        check_window(window, causal)
        common = {"mesh": self.mesh, "q_spec": self.q_spec, "kv_spec": self.kv_spec,
                  "segment_ids": segment_ids, "sinks": sinks}
        if self.strategy == RING:
            ring = Ring(self.axes, self.size, causal, self.balanced, window=window)
            return ring_attention(q, k, v, ring=ring, **common)
        kernel = all_gather_attention if self.strategy == ALL_GATHER else ulysses_attention
        return kernel(q, k, v, axis=self.axes, n=self.size, causal=causal, window=window,
                      **common)


def check_context_parallel(n_heads: int, seq_len: int, mesh, rules: Rules,
                           strategy: str) -> None:
    """User errors of a context-parallel run, in one line each, before anything compiles."""
    ContextParallel(mesh, rules, strategy).check(n_heads, seq_len)
