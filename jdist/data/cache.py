"""The token cache: the built-in corpus encoded by a Hugging Face tokenizer, kept on disk so
that only the first run with that tokenizer pays for encoding (seconds: see
docs/measurements.md#token-cache).

An entry is named by a digest of everything its ids depend on: the corpus bytes (the stdlib
of this Python), the tokenizer (its tokenizer.json bytes, eod id and vocabulary size), the
`tokenizers` library version and this file's encoding format. A changed input is a new name,
so an entry is never stale, only unused. Entries are written to a temporary file in the
same directory and renamed into place, so concurrent runs never read a partial one (two
runs that both miss write the same ids; the second rename wins). An unreadable entry is a
miss and is rewritten.

Where: `$JDIST_CACHE_DIR/tokens`, else `$XDG_CACHE_HOME/jdist/tokens`, else
`~/.cache/jdist/tokens`. Clear it with `python -m jdist.data clear-cache` (or delete the
directory): nothing else is kept there.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

FORMAT = 1  # bump when the ids written for the same inputs change (separators, dtype)


def cache_dir() -> Path:
    """Where token cache entries live (see the module docstring)."""
    root = os.environ.get("JDIST_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "jdist")
    return Path(root).expanduser() / "tokens"


def key(*parts: bytes | str) -> str:
    """The digest naming an entry: every input its ids depend on, length-prefixed so that
    no two different part lists hash alike."""
    h = hashlib.sha256(f"jdist-tokens-v{FORMAT};".encode())
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        h.update(f"{len(raw)}:".encode())
        h.update(raw)
    return h.hexdigest()[:32]


def _read(path: Path) -> np.ndarray | None:
    try:
        ids = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError):  # truncated or not an .npy: rewrite it
        return None
    return ids if ids.ndim == 1 and ids.dtype.kind == "u" else None


def _write(path: Path, ids: np.ndarray) -> None:
    """`ids` at `path` via a temporary file beside it and a rename (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, ids, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def cached(name: str, make: Callable[[], np.ndarray],
           where: Path | None = None) -> tuple[np.ndarray, Path, bool]:
    """The ids of entry `name` (from `key`): read from the cache, or made by `make()` and
    stored. Returns (ids, the entry's path, whether it was a hit). A cache that cannot be
    written is a warning on stderr; the run goes on with the ids it made."""
    path = (where or cache_dir()) / f"{name}.npy"
    ids = _read(path)
    if ids is not None:
        return ids, path, True
    ids = make()
    try:
        _write(path, ids)
    except OSError as e:
        print(f"jdist: warning: the tokenized corpus could not be cached in {path.parent} "
              f"({e.strerror or e}); set JDIST_CACHE_DIR to a writable directory to skip "
              "tokenizing next time", file=sys.stderr, flush=True)
    return ids, path, False


def clear(where: Path | None = None) -> tuple[int, int, Path]:
    """Delete every entry (and any temporary file a killed run left); returns (files, bytes,
    directory)."""
    root = where or cache_dir()
    files = [p for p in root.glob("*") if p.is_file() and
             (p.suffix == ".npy" or p.name.endswith(".tmp"))] if root.is_dir() else []
    size = 0
    for p in files:
        size += p.stat().st_size
        p.unlink(missing_ok=True)
    return len(files), size, root
