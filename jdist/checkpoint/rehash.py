"""Hashing a checkpoint's files: sha256 of one file, and re-hashing them all against the
manifest before a restore (`validate(full=True)`, the default). A flipped byte keeps every
size, and Orbax restores it as it is (its array files carry no checksum); a restore reads
the files anyway, so re-hashing costs mostly CPU: measured on 1 GiB in 8 arrays, 1.4-3.0 s
against 8-17 s for Orbax's restore of it (2 busy cores, warm page cache).

With several processes each re-hashes a share of the files, dealt by size the same way on
every process (a pure function of the manifest), so shared storage reads the checkpoint
once, not once per process; an all-gather makes them agree on the first mismatch, so every
process passes over, or restores, the same checkpoint.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

# hashlib releases the GIL, so files hash in parallel (OCDBT data files are ~2 GiB each).
HASH_THREADS = 4


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def deal(files: dict[str, dict], n: int) -> list[list[str]]:
    """The manifest's files in `n` shares of about equal bytes: largest first, each to the
    share with the fewest bytes so far."""
    shares, loads = [[] for _ in range(n)], [0] * n
    for rel in sorted(files, key=lambda r: (-files[r]["size"], r)):
        k = loads.index(min(loads))
        shares[k].append(rel)
        loads[k] += files[rel]["size"]
    return shares


def first_mismatch(path: Path, files: dict[str, dict]) -> str | None:
    """The first file (in manifest order) of the checkpoint at `path` whose sha256 is not
    the recorded one, or None. Call on every process (with several, they all-gather)."""
    order = list(files)
    mine = deal(files, jax.process_count())[jax.process_index()]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = dict(zip(mine, pool.map(lambda rel: sha256(path / rel), mine)))
    first = min((order.index(rel) for rel in mine if digests[rel] != files[rel]["sha256"]),
                default=len(order))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        first = int(np.min(multihost_utils.process_allgather(np.int32(first))))
    return order[first] if first < len(order) else None
