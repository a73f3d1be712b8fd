"""Checkpoint integrity without training: who hashed which file, the manifest formats, and
saves that fail for real (an unwritable directory, a write error inside Orbax) and are
reported, never followed by a claim of success."""

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess

import jax
import jax.numpy as jnp
import pytest

from jdist import checkpoint as ckpt

STATE = {"w": jnp.arange(4.0)}


def test_each_file_belongs_to_the_process_that_wrote_it():
    """The layout of a 2-process OCDBT checkpoint (Orbax 0.12.8)."""
    owners = {rel: ckpt.owner(rel, 2) for rel in (
        "state/ocdbt.process_1/d/e744b93be8b06d0d50e1ec6671314eee",
        "state/ocdbt.process_1/manifest.ocdbt", "state/array_metadatas/process_1",
        "state/ocdbt.process_0/d/0db721212fa6ce5275487d53aa7c4c16",
        "state/array_metadatas/process_0", "state/d/7333298d97243d74a153fa9755b35736",
        "state/manifest.ocdbt", "state/_METADATA", "meta/metadata", "_CHECKPOINT_METADATA")}
    assert [rel for rel, k in owners.items() if k == 1] == [
        "state/ocdbt.process_1/d/e744b93be8b06d0d50e1ec6671314eee",
        "state/ocdbt.process_1/manifest.ocdbt", "state/array_metadatas/process_1"]
    assert ckpt.owner("state/ocdbt.process_1/manifest.ocdbt", 1) == 0  # no such process


def test_partial_manifests_name_what_is_missing(tmp_path):
    ckpt.write_partial(tmp_path, 1, {"a": {"size": 1, "sha256": "x", "process": 1}}, None)
    ckpt.write_partial(tmp_path, 2, None, "OSError: [Errno 28] No space left on device")
    records, problems = ckpt.read_partials(tmp_path, 4)
    assert records == {"a": {"size": 1, "sha256": "x", "process": 1}}
    assert problems[0] == "process 2: OSError: [Errno 28] No space left on device"
    assert problems[1].startswith("process 3 recorded no hashes (FileNotFoundError")


def saved(tmp_path, step=1):
    saver = ckpt.Checkpointer(tmp_path / "checkpoints")
    saver.save(step, STATE, {"step": step})
    saver.close()
    return tmp_path / "checkpoints" / str(step)


def test_manifest_lists_every_file_and_validation_reads_only_on_request(tmp_path):
    path = saved(tmp_path)
    body = json.loads((path / ckpt.MANIFEST).read_text())
    assert body["format"] == ckpt.MANIFEST_FORMAT and body["processes"] == 1
    assert sorted(body["files"]) == sorted(ckpt._files(path))
    assert {f["process"] for f in body["files"].values()} == {0}
    assert not list(path.glob("jdist_manifest.process_*"))
    assert ckpt.validate(path) is None and ckpt.validate(path, full=True) is None
    data = max(ckpt._files(path).values(), key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))  # same size, other bytes
    assert ckpt.validate(path) is None
    assert "sha256" in ckpt.validate(path, full=True)
    data.write_bytes(data.read_bytes()[:-1])
    assert "truncated" in ckpt.validate(path)


def test_format_1_manifests_still_validate(tmp_path):
    """Checkpoints saved before the per-process hashes (format 1: no `process`)."""
    path = saved(tmp_path)
    body = json.loads((path / ckpt.MANIFEST).read_text())
    old = {"format": "jdist-checkpoint-manifest/1", "step": 1,
           "total_bytes": body["total_bytes"],
           "files": {rel: {"size": f["size"], "sha256": f["sha256"]}
                     for rel, f in body["files"].items()}}
    (path / ckpt.MANIFEST).write_text(json.dumps(old))
    assert ckpt.validate(path) is None and ckpt.validate(path, full=True) is None
    assert ckpt.latest_good(path.parent, full=True).step == 1


@contextlib.contextmanager
def unwritable(directory):
    """`directory` refuses new entries, for real: by its mode for a user, by the immutable
    attribute for root (whom the mode does not stop; needs chattr and ext4 or alike)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(directory)], capture_output=True, check=False).returncode:
        pytest.skip("running as root where chattr +i does not work")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_a_save_into_an_unwritable_directory_fails_and_the_next_save_retries(tmp_path,
                                                                             capsys):
    root = tmp_path / "checkpoints"
    saver = ckpt.Checkpointer(root)
    saver.save(1, STATE, {"step": 1})
    saver.wait()
    with unwritable(root):
        saver.save(2, STATE, {"step": 2})  # training goes on
        with pytest.raises(ckpt.SaveFailed) as failed:
            saver.wait()
        saver.wait()  # raised once: a `finally: close()` does not report it again
        assert saver.failure is failed.value and saver.last_good == 1
        saver.save(3, STATE, {"step": 3})  # fails too; step 2's failure was raised: not said
        assert "step 2" not in capsys.readouterr().err
    message = str(failed.value)
    assert "\n" not in message and message.startswith("checkpoint: saving step 2 failed: ")
    assert f"check that {root} is writable and has space" in message
    assert message.endswith("the last good checkpoint is step 1")
    assert (failed.value.step, failed.value.last_good) == (2, 1)
    assert ckpt.latest_good(root).step == 1
    saver.save(4, STATE, {"step": 4})  # writable again
    saver.close()
    said = [x for x in capsys.readouterr().err.splitlines() if "failed" in x]
    assert len(said) == 1 and said[0].startswith("checkpoint: saving step 3 failed: "), said
    assert said[0].endswith("; retrying with step 4") and saver.failure is None
    assert saver.last_good == 4 and ckpt.latest_good(root).step == 4
    assert ckpt.validate(root / "4", full=True) is None


def test_a_write_error_inside_orbax_is_reported_and_a_fresh_manager_retries(tmp_path):
    """A real I/O error in Orbax's background commit: a file-size limit (RLIMIT_FSIZE, which
    binds root too) below one array's data file makes tensorstore's write fail (EFBIG)."""
    root = tmp_path / "checkpoints"
    noise = {"w": jax.random.normal(jax.random.key(0), (1 << 18,))}  # 1 MiB, incompressible
    saver = ckpt.Checkpointer(root)
    saver.save(1, noise, {"step": 1})
    saver.wait()
    first_manager = saver._manager
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    default = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death by signal
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, hard))
        saver.save(2, noise, {"step": 2})
        with pytest.raises(ckpt.SaveFailed, match=r"saving step 2 failed: .*File too large"):
            saver.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, default)
    assert ckpt.validate(root / "2") is not None and ckpt.latest_good(root).step == 1
    saver.save(2, noise, {"step": 2})  # the same step again: the failed one is no obstacle
    assert saver._manager is not first_manager
    saver.close()
    assert ckpt.latest_good(root).step == 2 and ckpt.validate(root / "2", full=True) is None
    assert not list(root.glob("*.orbax-checkpoint-tmp*"))
