"""Checkpoint integrity: what a good checkpoint is, and finding one.

The on-disk layout's names (MANIFEST, STATE, META, ...), the file records (size, sha256,
writing process) that every process takes of the files it wrote, the partial manifests
processes 1.. leave for process 0 and the manifest it writes from them, `validate` (sizes,
or with `full` every hash), the newest good checkpoint under a root (`latest_good`) or the
one a `--resume PATH` names (`resolve_explicit`), and moving unusable ones aside. Reads and
writes plain files only (no Orbax); devices only to agree on a re-hash (`rehash`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import jax

from jdist.checkpoint.rehash import HASH_THREADS, first_mismatch
from jdist.checkpoint.rehash import sha256 as _sha256
from jdist.errors import ConfigError
from jdist.files import write_atomically

MANIFEST = "jdist_manifest.json"
MANIFEST_FORMAT = "jdist-checkpoint-manifest/2"  # /2 added "process" to each file
READABLE_FORMATS = ("jdist-checkpoint-manifest/1", MANIFEST_FORMAT)
PARTIAL = "jdist_manifest.process_{}.json"  # one process's hashes, until process 0 merges them
STATE, META = "state", "meta"
BAD_DIR_SUFFIX = ".bad"  # sibling of the checkpoint root; where unusable checkpoints are moved
# Per-process directories and files of an OCDBT checkpoint (Orbax 0.12.8): ocdbt.process_1/,
# array_metadatas/process_1.
_PROCESS_PART = re.compile(r"(?:ocdbt\.)?process_(\d+)")


@dataclasses.dataclass(frozen=True)
class Found:
    """A good checkpoint chosen for restore, and the newer ones that were passed over."""

    path: Path
    step: int
    meta: dict
    skipped: tuple[tuple[Path, str], ...] = ()


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"checkpoint: {message}", flush=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _reason(e: BaseException | str) -> str:
    """An exception as one short line. Orbax's can span many, and tensorstore's name the
    cause (e.g. "File too large") only at their end, after long paths: keep both ends."""
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    text = " ".join(text.split())
    return text if len(text) <= 400 else f"{text[:200]} ... {text[-195:]}"


def _files(path: Path) -> dict[str, Path]:
    """Every file of a checkpoint but its manifests (as paths relative to it)."""
    return {str(p.relative_to(path)): p for p in sorted(path.rglob("*"))
            if p.is_file() and not p.name.startswith("jdist_manifest")}


def owner(rel: str, process_count: int) -> int:
    """The process that wrote file `rel` of a checkpoint saved by `process_count` processes."""
    for part in PurePosixPath(rel).parts:
        m = _PROCESS_PART.fullmatch(part)
        if m and int(m.group(1)) < process_count:
            return int(m.group(1))
    return 0  # the primary host writes everything that is not per-process


def file_records(path: Path, process: int = 0, process_count: int = 1) -> dict[str, dict]:
    """Size and sha256 of the files of the checkpoint at `path` that `process` wrote."""
    mine = {rel: p for rel, p in _files(path).items() if owner(rel, process_count) == process}
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        hashes = dict(zip(mine, pool.map(_sha256, mine.values())))
    return {rel: {"size": p.stat().st_size, "sha256": hashes[rel], "process": process}
            for rel, p in mine.items()}


def _write_json(path: Path, body: dict) -> None:
    write_atomically(path, json.dumps(body, indent=1))


def write_manifest(path: Path, step: int, records: dict[str, dict] | None = None,
                   processes: int = 1) -> int:
    """Write the manifest of the committed checkpoint at `path` from every process's
    `records` (hashed here, as one process, when None); returns its total bytes."""
    files = file_records(path) if records is None else dict(sorted(records.items()))
    total = sum(f["size"] for f in files.values())
    _write_json(path / MANIFEST, {"format": MANIFEST_FORMAT, "step": step,
                                  "processes": processes, "total_bytes": total, "files": files})
    return total


def write_partial(path: Path, process: int, records: dict | None, error: str | None) -> None:
    """One process's hashes (or why it has none), for process 0 to merge."""
    _write_json(path / PARTIAL.format(process),
                {"format": MANIFEST_FORMAT, "process": process, "files": records,
                 "error": error})


def read_partials(path: Path, process_count: int) -> tuple[dict[str, dict], list[str]]:
    """The hashes of processes 1.. from their partial manifests, and what is wrong with any."""
    records, problems = {}, []
    for k in range(1, process_count):
        try:
            body = json.loads((path / PARTIAL.format(k)).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"process {k} recorded no hashes ({_reason(e)})")
            continue
        if body.get("error") or not isinstance(body.get("files"), dict):
            problems.append(f"process {k}: {body.get('error') or 'no files'}")
        else:
            records.update(body["files"])
    return records, problems


def validate(path: Path, full: bool = False) -> str | None:
    """None if the checkpoint at `path` is complete and intact, else why it is not. Every
    file the manifest lists must exist with its recorded size (one stat a file: catches a
    deleted or truncated file); `full` also re-reads and re-hashes every file (catches a
    same-size corruption, which Orbax restores without complaint: its array files carry no
    checksum; see `rehash`). Call `full` on every process."""
    manifest = path / MANIFEST
    if not path.is_dir():
        return "not a directory"
    if not manifest.is_file():
        return f"no {MANIFEST} (its save never finished)"
    try:
        body = json.loads(manifest.read_text())
        files = body["files"]
        # Checked explicitly, not by `assert`: `python -O` must still validate.
        well_formed = (body["format"] in READABLE_FORMATS and isinstance(files, dict)
                       and files and all("size" in f and "sha256" in f for f in files.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        well_formed = False
    if not well_formed:
        return f"{MANIFEST} is unreadable"
    for rel, want in files.items():
        p = path / rel
        if not p.is_file():
            return f"file {rel} is missing"
        if p.stat().st_size != want["size"]:
            return f"file {rel} has {p.stat().st_size} bytes, expected {want['size']} (truncated?)"
    bad = first_mismatch(path, files) if full else None
    if bad is not None:
        return f"file {bad} does not match its recorded sha256 (corrupted or modified)"
    return None


def read_meta(path: Path) -> dict:
    """The JSON metadata of a checkpoint (run config, step, data position)."""
    return json.loads((path / META / "metadata").read_text())


def checkpoint_root(run_dir: Path) -> Path:
    """Where a run directory keeps its step checkpoints."""
    return Path(run_dir) / "checkpoints"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed step directories under a checkpoint root, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def latest_good(root: Path, full: bool = True) -> Found | None:
    """The newest good checkpoint under `root`, or None; remembers the bad ones passed over.
    `full`: re-hash each candidate (see `validate`), else only check sizes."""
    skipped = []
    for step, path in reversed(step_dirs(root)):
        problem = validate(path, full)
        if problem is None:
            return Found(path, step, read_meta(path), tuple(skipped))
        skipped.append((path, problem))
    if skipped:
        return Found(Path(), -1, {}, tuple(skipped))  # nothing usable, but something was there
    return None


def resolve_explicit(text: str, flag: str = "--resume", full: bool = True) -> Found:
    """`--resume PATH`: a step directory, or a run/checkpoint directory meaning its newest
    step. It must be good (`full`: re-hashed, else only sizes checked; see `validate`): an
    explicit request never falls back."""
    path = Path(text)
    if path.is_dir() and not (path / MANIFEST).exists() and not (path / STATE).exists():
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = step_dirs(root)
        if not steps:
            # Name what is there, never a directory that does not exist.
            if (path / "config.json").is_file() or (path / "metrics.jsonl").is_file():
                raise ConfigError(
                    f"{flag} {text}: that run saved no checkpoint (it ran with "
                    "--no-final-checkpoint or stopped before a save); train it again, which "
                    "ends with a checkpoint in RUN_DIR/checkpoints/<step>")
            raise ConfigError(f"{flag} {text}: no checkpoints found there (neither a run "
                              "directory with checkpoints/<step> nor a checkpoint); pass the "
                              "--run-dir of a python -m jdist.train run or one of its steps")
        path = steps[-1][1]
    if not path.exists():
        near = [str(p) for _, p in step_dirs(path.parent)]
        raise ConfigError(f"{flag} {text}: no such checkpoint; " + (
            f"the checkpoints there are {', '.join(near)}" if near
            else "pass an existing checkpoint directory"))
    problem = validate(path, full)
    if problem is not None:
        if flag == "--resume":
            hint = "pass an earlier checkpoint (or --resume auto to take the newest good one)"
        else:  # only training has --resume auto; generate and export take a step directory
            others = [str(p) for s, p in step_dirs(path.parent) if str(s) != path.name]
            hint = "pass another checkpoint" + (f" ({', '.join(others)})" if others else "")
        raise ConfigError(f"{flag} {text}: checkpoint is not usable: {problem}; {hint}")
    return Found(path, int(read_meta(path)["step"]), read_meta(path))


def move_aside(path: Path, root: Path) -> None:
    """Move the checkpoint at `path` out of the checkpoint root `root` into ROOT.bad/."""
    dest = root.parent / (root.name + BAD_DIR_SUFFIX)
    dest.mkdir(parents=True, exist_ok=True)
    path.rename(dest / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
