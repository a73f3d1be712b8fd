"""Checkpoints: Orbax async sharded saves, integrity manifests, and restore onto any mesh.

Layout of a run's checkpoints (`RUN_DIR/checkpoints/`), one directory per step:

    <step>/state/...             the TrainState as an Orbax PyTree (OCDBT + zarr; no pickle)
    <step>/meta/metadata         JSON: step, data position, seed, run config, model, mesh
    <step>/jdist_manifest.json   size and sha256 of every other file and which process wrote
                                 it, written by process 0 after Orbax has committed the step

Who writes which file (Orbax 0.12.8, OCDBT): process k writes its shards under
`state/ocdbt.process_k/` and `state/array_metadatas/process_k`; process 0 (Orbax's primary
host) writes everything else, including the merged `state/manifest.ocdbt` and `state/d/`
that point into every process's files. Each process hashes the files it wrote right after
the commit, while they are still in its page cache, instead of process 0 re-reading them
all; with several processes each leaves its hashes in `<step>/jdist_manifest.process_k.json`
for process 0 to merge (and delete).

Orbax writes a step into a temporary directory and renames it when every process has
finished, so a killed save never leaves a `<step>` directory. The manifest is written
after that commit and is what makes a checkpoint *good*: a checkpoint without one (killed
between commit and manifest) or whose files do not match it (deleted, truncated or
corrupted in place: every file is re-hashed before a restore, unless a caller asks for the
size check alone with `full=False`) is never restored. Old checkpoints are pruned only once
a newer one is good, so the newest `keep` good checkpoints always survive. A save that
fails is recorded, said once, and raised as SaveFailed by `Checkpointer.wait()`; the next
save retries.

Modules, by concern (everything callers use is re-exported here, so
`from jdist.checkpoint import X` and `jdist.checkpoint.X` are the interface):

    integrity.py  layout names, file records, manifests and partials, validate,
                  latest_good, resolve_explicit, moving bad checkpoints aside
    restoring.py  abstract_target, restore (onto any mesh), restore_leaf, restore_only, set_aside
                  (not restore.py: the package's restore() would hide that module, so
                  `import jdist.checkpoint.restore as m` and mock.patch would get the
                  function)
    rehash.py     sha256 of a file; re-hashing a checkpoint before a restore, shared out
                  between processes
    save.py       Checkpointer (async saves, manifest, prune, retry), SaveFailed
"""

from jdist.checkpoint.integrity import (
    BAD_DIR_SUFFIX,
    HASH_THREADS,
    MANIFEST,
    MANIFEST_FORMAT,
    META,
    PARTIAL,
    READABLE_FORMATS,
    STATE,
    Found,
    _files,
    _mib,
    _reason,
    _say,
    checkpoint_root,
    file_records,
    latest_good,
    move_aside,
    owner,
    read_meta,
    read_partials,
    resolve_explicit,
    step_dirs,
    validate,
    write_manifest,
    write_partial,
)
from jdist.checkpoint.rehash import deal, first_mismatch
from jdist.checkpoint.restoring import (
    abstract_target,
    restore,
    restore_leaf,
    restore_only,
    set_aside,
)
from jdist.checkpoint.save import BARRIER_TIMEOUT_S, Checkpointer, SaveFailed

__all__ = [
    "BAD_DIR_SUFFIX", "BARRIER_TIMEOUT_S", "HASH_THREADS", "MANIFEST", "MANIFEST_FORMAT",
    "META", "PARTIAL", "READABLE_FORMATS", "STATE", "Checkpointer", "Found", "SaveFailed",
    "abstract_target", "checkpoint_root", "deal", "file_records", "first_mismatch",
    "latest_good", "move_aside", "owner", "read_meta",
    "read_partials", "resolve_explicit", "restore", "restore_leaf", "restore_only", "set_aside",
    "step_dirs", "validate", "write_manifest", "write_partial",
    # Private, but used by jdist.train.resume (_say) and tests (_files).
    "_files", "_mib", "_reason", "_say",
]
