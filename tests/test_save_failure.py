"""A checkpoint save that fails for real in the middle of a `python -m jdist.train` run: the
run says so (one line a failed save, no traceback) and exits with status 5, and the rerun
resumes from the last good checkpoint.

The failure is a full disk. RUN_DIR/checkpoints is a tmpfs with room for one checkpoint of
this run but not two, so the first save (step 2) lands and the second (step 4) runs out of
space inside Orbax's background write, as does the retry at the final save (step 5): the
same failures on every run, with no timing involved. (Making the directory unwritable once
the first save has landed would race the run's next save; and Orbax overwrites whatever
is in a step's place, so nothing can be put there in advance.) Mounting needs root with
CAP_SYS_ADMIN; elsewhere the test is skipped."""

import json
import shutil
import subprocess
import sys

import pytest

from jdist import checkpoint as ckpt

ARGS = ["--model", "tiny", "--mesh", "dp=2,fsdp=2", "--batch-size", "8", "--seq-len", "32",
        "--steps", "5", "--checkpoint-every", "2", "--eval-every", "0",
        "--check-replicas-every", "0"]
# One checkpoint of this run takes about 1.2 MB of tmpfs (20 files, 1.10 MiB of data).
ROOM_FOR_ONE = "1800k"


def train(run_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jdist.train", *ARGS, "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300, check=False)


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def small_disk(tmp_path):
    """RUN_DIR/checkpoints on a tmpfs of ROOM_FOR_ONE; yields (run dir, checkpoint root)."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    root.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={ROOM_FOR_ONE}", "tmpfs", str(root)]
    if shutil.which("mount") is None or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("needs to mount a small tmpfs (root with CAP_SYS_ADMIN)")
    try:
        yield run_dir, root
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_a_save_failing_mid_run_exits_5_and_the_rerun_resumes_from_the_last_good(small_disk):
    run_dir, root = small_disk
    first = train(run_dir)
    assert first.returncode == 5, first.stderr
    assert "Traceback" not in first.stderr and "ERROR:" not in first.stderr, first.stderr
    saved = [x for x in first.stdout.splitlines() if x.startswith("checkpoint: saved step")]
    assert len(saved) == 1 and saved[0].startswith(f"checkpoint: saved step 2 to {root / '2'} ")
    said = [x for x in first.stderr.splitlines() if "failed" in x]
    assert len(said) == 2, first.stderr
    # The save of step 4 failed in the background while training went on; the next save
    # (the final one, step 5) said so, retried, and failed too: that is the one error.
    notice, error = said
    tail = f"; check that {root} is writable and has space; the last good checkpoint is step 2"
    assert notice.startswith("checkpoint: saving step 4 failed: ")
    assert notice.endswith(f"{tail}; retrying with step 5"), notice
    assert error.startswith("jdist: error: checkpoint: saving step 5 failed: ")
    assert error.endswith(tail), error
    assert "No space left on device" in notice and "No space left on device" in error
    assert [x for x in first.stderr.splitlines() if x.startswith("jdist: error")] == [error]
    # Neither failed step is a good checkpoint; step 2 is, and is what a resume takes.
    assert ckpt.latest_good(root).step == 2 and ckpt.validate(root / "2", full=True) is None
    assert all(ckpt.validate(p) is not None for s, p in ckpt.step_dirs(root) if s != 2)
    before = metrics(run_dir)
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5]  # it trained to the end

    # Free the disk and run the same command again.
    subprocess.run(["mount", "-o", "remount,size=16m", str(root)], check=True)
    again = train(run_dir)
    assert again.returncode == 0, again.stderr
    assert "failed" not in again.stderr and "Traceback" not in again.stderr, again.stderr
    assert f"checkpoint: restored step 2 from {root / '2'} " in again.stdout, again.stdout
    for step in (4, 5):
        assert f"checkpoint: saved step {step} to {root / str(step)} " in again.stdout
    after = metrics(run_dir)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]  # steps 3-5 redone, not repeated
    assert [r["loss"] for r in after] == [r["loss"] for r in before]  # bitwise: from step 2
    assert len(json.loads((run_dir / "goodput.json").read_text())["runs"]) == 2
    assert ckpt.latest_good(root).step == 5 and ckpt.validate(root / "5", full=True) is None
    assert not list(root.glob("*.orbax-checkpoint-tmp*"))  # the failed saves' leftovers
