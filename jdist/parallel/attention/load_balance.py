"""Causal load balancing for context parallelism.

With a causal mask, query i attends to keys 0..i, so a device holding the last contiguous
slice of the sequence does N times the work of the first. Cut the sequence into 2N chunks
and give device j chunks j and 2N-1-j: every device then holds one early and one late
chunk and the same amount of unmasked work. The reorder is a fixed permutation of token
positions applied inside the step (tokens, targets and rotary positions alike), so the
loss, a mean over tokens, is unchanged and the data order never depends on the mesh.
"""

from __future__ import annotations

import numpy as np

# What one device computes for a (query chunk, key chunk) pair, by chunk positions.
SKIP, FULL, DIAG = 0, 1, 2


def chunk_ids(device: int, n: int, balanced: bool) -> tuple:
    """Global chunk indices of the sequence chunks device `device` of `n` holds, in order.

    Balanced: two chunks of S/2N (j and 2N-1-j); otherwise one contiguous chunk of S/N.
    Works on Python ints and traced integers alike.
    """
    return (device, 2 * n - 1 - device) if balanced else (device,)


def block_kind(q_chunk, k_chunk, causal: bool, xp=np, chunk_len: int = 0,
               window: int | None = None):
    """SKIP when every query precedes every key, DIAG (computed under the mask) when the
    chunks coincide, else FULL. With a sliding `window` (chunks of `chunk_len` tokens),
    SKIP too when even the nearest pair lies `window` or more apart, and DIAG for the rest,
    whose far corner the window may cut."""
    if not causal:
        return FULL
    kind = xp.where(q_chunk > k_chunk, FULL, xp.where(q_chunk == k_chunk, DIAG, SKIP))
    if window is None:
        return kind
    beyond = (q_chunk - k_chunk - 1) * chunk_len + 1 >= window
    return xp.where(beyond | (kind == SKIP), SKIP, DIAG)


def balanced_order(seq_len: int, n: int) -> np.ndarray:
    """Original positions of the tokens, in the order the balanced layout stores them."""
    chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
    return np.concatenate([chunks[c] for j in range(n) for c in chunk_ids(j, n, True)])


def ring_work(n: int, balanced: bool, causal: bool = True, window: int | None = None,
              seq_len: int = 0) -> list[int]:
    """Blocks each device computes over the whole ring, in units of (S/2N)^2 score tiles
    (a sliding `window` needs the `seq_len` it counts in).

    This walks the same schedule the ring kernel runs (device j meets the keys of device
    j - step at each step) and counts what it does not skip.
    """
    tiles = 1 if balanced else 4  # a contiguous chunk is twice as long: 4 tiles per block
    chunk_len = seq_len // (2 * n if balanced else n)
    work = []
    for j in range(n):
        total = 0
        for step in range(n):
            owner = (j - step) % n
            for qc in chunk_ids(j, n, balanced):
                for kc in chunk_ids(owner, n, balanced):
                    kind = block_kind(qc, kc, causal, np, chunk_len, window)
                    total += tiles * int(kind != SKIP)
        work.append(total)
    return work
