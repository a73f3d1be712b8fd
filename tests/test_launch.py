"""`python -m jdist.launch`: 2 local processes x 4 CPU devices (jax.distributed, gloo).
Checkpoints move between process counts; a dead process takes the group down quickly;
--max-restarts resumes the group from its newest checkpoint; GPUs are split between the
processes (the assignment as a pure function: there is no GPU here)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jdist import checkpoint as ckpt
from jdist.config import TrainConfig
from jdist.launch import Group, device_env, split_devices, visible_devices
from jdist.train.loop import train

ARGS = ["--model", "tiny", "--mesh", "dp=2,fsdp=4", "--steps", "8", "--batch-size", "16",
        "--seq-len", "32", "--warmup", "2", "--eval-every", "0", "--log-every", "1",
        "--checkpoint-every", "4"]


def launch(*extra, max_restarts: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jdist.launch", "--nproc", "2",
                             "--max-restarts", str(max_restarts), "--", *ARGS, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def pid_of(lines: list[str], i: int) -> int:
    return int(next(x for x in lines if f"started process {i} (pid" in x).split("pid ")[1][:-2])


def read_until(proc, text: str, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return
    raise AssertionError(f"never saw {text!r}:\n" + "".join(lines))


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 8 devices: the reference losses and a checkpoint at step 4."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train(TrainConfig.of(model="tiny", mesh="dp=2,fsdp=4", steps=8, batch_size=16, seq_len=32,
                         warmup=2, eval_every=0, checkpoint_every=4, run_dir=str(run_dir)))
    return run_dir, losses(run_dir)


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-5 * abs(b[k]) for k in a)


def test_killed_process_stops_the_group(tmp_path):
    proc = launch("--run-dir", str(tmp_path / "run"))
    lines: list[str] = []
    try:
        read_until(proc, "step 1/8", lines)  # both are training, in each other's collectives
        start = time.monotonic()
        os.kill(pid_of(lines, 1), signal.SIGKILL)
        lines += proc.communicate(timeout=60)[0].splitlines(keepends=True)
    finally:
        proc.kill()
    assert proc.returncode != 0, "".join(lines)
    assert time.monotonic() - start < 60
    # Process 0 fails too once its peer is gone, often before the launcher looks; the one
    # named is the one that failed first (test_first_failure_is_named_by_exit_time).
    stops = [x for x in lines if "; stopping the group" in x]
    assert stops == ["[launch] process 1 exited with status -9; stopping the group\n"], stops


def test_first_failure_is_named_by_exit_time(capsys):
    """Process 1 fails, then process 0, both before the launcher first looks: the launcher
    names process 1 and returns its status, not the lower-numbered one's."""
    group = Group([["sh", "-c", "sleep 1; exit 1"], ["sh", "-c", "exit 9"]],
                  [dict(os.environ)] * 2)
    time.sleep(2)  # both have exited
    assert group.wait() == 9
    out = capsys.readouterr().out
    assert "process 1 exited with status 9; stopping the group" in out, out
    assert "process 0 exited" not in out, out


def test_restart_resumes_two_process_checkpoint_and_it_moves_to_one(tmp_path, single):
    run_dir = tmp_path / "run"
    proc = launch("--run-dir", str(run_dir), max_restarts=1)
    lines: list[str] = []
    try:
        read_until(proc, "checkpoint: saved step 4", lines)
        os.kill(pid_of(lines, 1), signal.SIGKILL)
        lines += proc.communicate(timeout=300)[0].splitlines(keepends=True)
    finally:
        proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "restart 1/1" in out and "restored step" in out and "all processes finished" in out
    assert close(losses(run_dir), single[1])
    # The 2-process checkpoint at step 4 restores in one process on the same mesh.
    history = train(TrainConfig.of(model="tiny", mesh="dp=2,fsdp=4", steps=8, batch_size=16,
                                   seq_len=32, warmup=2, eval_every=0,
                                   run_dir=str(tmp_path / "one"),
                                   resume=str(run_dir / "checkpoints" / "4")))
    assert close({r["step"]: r["loss"] for r in history}, {s: single[1][s] for s in (5, 6, 7, 8)})


def test_one_process_checkpoint_restores_in_two(tmp_path, single):
    """... and each process hashes its own files of the 2-process checkpoint it saves. With
    CUDA_VISIBLE_DEVICES set (no GPU here: JAX stays on the CPU), each gets its own GPU."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc", "2", "--", *ARGS,
                           "--run-dir", str(run_dir),
                           "--resume", str(single[0] / "checkpoints" / "4")],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,5"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "process 0 sees CUDA_VISIBLE_DEVICES=4" in done.stdout
    assert "process 1 sees CUDA_VISIBLE_DEVICES=5" in done.stdout
    assert close(losses(run_dir), {s: single[1][s] for s in (5, 6, 7, 8)})
    path = run_dir / "checkpoints" / "8"
    assert ckpt.validate(path, full=True) is None
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert manifest["processes"] == 2 and not list(path.glob("jdist_manifest.process_*"))
    by = {k: [r for r, f in manifest["files"].items() if f["process"] == k] for k in (0, 1)}
    assert by[1] and all("process_1" in r for r in by[1])
    assert sorted(by[0] + by[1]) == sorted(ckpt._files(path))


def test_two_processes_share_the_rehash_and_agree_to_fall_back(tmp_path, single):
    """A flipped byte in the newest checkpoint, resumed by 2 processes: each re-hashes about
    half the files, so only one finds it; they agree (one line says so), both restore step 4
    and finish as the uninterrupted run did."""
    run_dir = tmp_path / "run"
    shutil.copytree(single[0], run_dir)
    newest = run_dir / "checkpoints" / "8"
    files = json.loads((newest / ckpt.MANIFEST).read_text())["files"]
    victim = max(files, key=lambda rel: files[rel]["size"])
    shares = ckpt.deal(files, 2)  # the victim is in one share; the other process hashes the rest
    assert all(shares) and sum(victim in share for share in shares) == 1, shares
    raw = bytearray((newest / victim).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (newest / victim).write_bytes(bytes(raw))
    done = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc", "2", "--", *ARGS,
                           "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    said = [x for x in out.splitlines() if "falling back" in x]
    assert len(said) == 1 and victim in said[0] and "sha256" in said[0], said
    assert "restored step 4" in out
    assert close({s: v for s, v in losses(run_dir).items() if s > 4},
                 {s: single[1][s] for s in (5, 6, 7, 8)})


SMI = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0c2d)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1a7e)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-5f00)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-77b1)
"""


def test_gpus_are_split_evenly_and_disjointly():
    assert split_devices(list("01234567"), 4) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert device_env({}, 2, lambda: SMI) == [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                             {"CUDA_VISIBLE_DEVICES": "2,3"}]
    # A variable already set wins over nvidia-smi, in its order and its ids (here UUIDs).
    env = {"CUDA_VISIBLE_DEVICES": "GPU-77b1,GPU-0c2d"}
    assert device_env(env, 2, lambda: SMI) == [{"CUDA_VISIBLE_DEVICES": "GPU-77b1"},
                                               {"CUDA_VISIBLE_DEVICES": "GPU-0c2d"}]
    assert device_env({"HIP_VISIBLE_DEVICES": "0,1"}, 1, lambda: None) == [
        {"HIP_VISIBLE_DEVICES": "0,1"}]
    # The CPU: nothing to split (the processes share it, as before).
    assert visible_devices({}, lambda: None) is None  # no nvidia-smi
    for env in ({"JAX_PLATFORMS": "cpu"}, {"CUDA_VISIBLE_DEVICES": ""},
                {"CUDA_VISIBLE_DEVICES": "-1"}):
        assert device_env(env, 3, lambda: SMI) == [{}, {}, {}]
    with pytest.raises(ValueError, match=r"4 GPUs \(CUDA_VISIBLE_DEVICES=0,1,2,3\) do not "
                                         r"split evenly over --nproc 3; pass an --nproc that "
                                         "divides 4"):
        device_env({}, 3, lambda: SMI)


def test_launcher_refuses_gpus_that_do_not_split_before_starting_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc", "3", "--", *ARGS,
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=60, check=False,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.splitlines() == [
        "jdist.launch: error: 4 GPUs (CUDA_VISIBLE_DEVICES=0,1,2,3) do not split evenly over "
        "--nproc 3; pass an --nproc that divides 4, or set CUDA_VISIBLE_DEVICES to a multiple "
        "of 3 devices"]
    # The launcher itself never imports JAX (which would take memory on every GPU).
    probe = "import sys, jdist.launch; print('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
