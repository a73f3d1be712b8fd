"""Elastic `python -m jdist.launch`: local processes stand for hosts. A host lost for good is
excluded, the layout re-planned for the hosts left (same model and global batch, gradient
accumulation absorbing the smaller per-step batch) and the run resumes from its newest
checkpoint with the losses of a run that switched meshes at that step; a host listed again
is taken back at the next checkpoint; nothing left to run on is one line and exit 2."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jdist.config import TrainConfig
from jdist.errors import ConfigError
from jdist.launch.elastic import DEFAULT_MESH, Elastic
from jdist.launch.hosts import HostTable
from jdist.launch.replan import original_layout, replan
from jdist.launch.watch import Watch
from jdist.train.loop import train

SHAPE = dict(model="tiny", steps=8, batch_size=16, seq_len=32, warmup=2, eval_every=0,
             checkpoint_every=2)
ARGS = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()] + ["--log-every", "1"]


def launch(*launcher_flags, train_flags=(), nproc=2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jdist.launch", "--nproc", str(nproc),
                             "--max-restarts", "2", *launcher_flags, "--", *ARGS,
                             *train_flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc, text: str, lines: list[str]) -> str:
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return line
    raise AssertionError(f"never saw {text!r}:\n" + "".join(lines))


def pid_of(lines: list[str], i: int) -> int:
    return int(next(x for x in lines if f"started process {i} (pid" in x).split("pid ")[1][:-2])


def losses(run_dir) -> dict[int, float]:
    """Each step's loss, the redone steps' from their last run."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-5 * abs(b[k]) for k in a)


def test_replan_shrinks_the_data_axes_and_accumulates_what_they_lost():
    full = original_layout({"data": 2, "fsdp": 4}, 1, hosts=2)
    one = replan(full, hosts_left=1, per_host=4)
    assert (one.mesh(), one.grad_accum, one.hosts) == ("fsdp=4", 2, 1)
    assert replan(full, 2, 4) == full  # all hosts back: the original layout
    # 4 hosts of 2 devices, 3 left: 6 devices cannot hold 8 micro-batches evenly; 2 hosts can.
    three = replan(original_layout({"data": 2, "fsdp": 4}, 1, hosts=4), 3, 2)
    assert (three.mesh(), three.grad_accum, three.hosts) == ("fsdp=4", 2, 2)
    # Model axes stay whole.
    tp = replan(original_layout({"data": 2, "fsdp": 2, "tensor": 2}, 2, hosts=2), 1, 4)
    assert (tp.mesh(), tp.grad_accum) == ("fsdp=2,tp=2", 4)
    with pytest.raises(ConfigError, match="model axes tp=8 need 8 devices but 4 are left"):
        replan(original_layout({"tensor": 8}, 1, hosts=2), 1, 4)
    assert DEFAULT_MESH == TrainConfig().parallel.mesh


def run_launcher(tmp_path, listed: str | None, *train_flags, nproc: int,
                 kill: int | None = None, launcher_flags=()):
    """The launcher on a hosts file listing `listed` (None: no file); `kill`: SIGKILL that
    process as soon as it starts (a host lost before it trained), the file then listing
    `listed` only."""
    hosts = tmp_path / "hosts"
    if listed is not None:
        hosts.write_text(listed if kill is None else " ".join(map(str, range(nproc))))
        launcher_flags = (*launcher_flags, "--hosts-file", str(hosts), "--host-deadline", "0")
    proc = launch(*launcher_flags, train_flags=(*train_flags, "--run-dir", tmp_path / "run"),
                  nproc=nproc)
    lines: list[str] = []
    try:
        if kill is not None:
            read_until(proc, f"started process {nproc - 1} (pid", lines)
            if listed is not None:
                hosts.write_text(listed)
            os.kill(pid_of(lines, kill), signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, "".join(lines) + out, err


def test_losing_the_only_host_is_one_line_and_exit_2(tmp_path):
    no_devices = ("jdist.launch: error: no devices left: the only host is excluded; bring a "
                  "host back (list it in --hosts-file) and rerun with --resume auto")
    for listed, flags in (("", ()), (None, ("--max-host-failures", "1"))):
        code, out, err = run_launcher(tmp_path, listed, "--mesh", "fsdp=4", nproc=1, kill=0,
                                      launcher_flags=flags)
        assert (code, err.splitlines()) == (2, [no_devices]), out + err
        assert "host 0 failed" in out and ": excluded" in out
    # Not listed from the start: refused before anything runs.
    code, out, err = run_launcher(tmp_path, "# none yet\n", "--mesh", "fsdp=4", nproc=1)
    assert (code, out, err.splitlines()) == (2, "", [no_devices])
    # Elastic flags act on restarts: without any, one line says so.
    done = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc", "1",
                           "--max-host-failures", "1", "--", *ARGS], capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [
        "jdist.launch: error: --max-host-failures, --hosts-file and --exclude-stragglers act "
        "when the group restarts; give --max-restarts K too"])


def test_a_plan_that_no_longer_fits_is_one_line_and_exit_2(tmp_path):
    code, out, err = run_launcher(tmp_path, "0", "--mesh", "tp=8", nproc=2, kill=1)
    assert code == 2, out + err
    assert err.splitlines() == [
        "jdist.launch: error: the plan no longer fits: its model axes tp=8 need 8 devices "
        "but 4 are left (1 host of 4); bring hosts back or restart with a smaller --mesh"], err
    assert "host 1 failed and not back in" in out


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """One process, the full mesh (dp=2,fsdp=4), no failure: losses and a checkpoint every
    2 steps to switch meshes from."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    train(TrainConfig.of(**SHAPE, mesh="dp=2,fsdp=4", run_dir=str(run_dir)))
    return run_dir, losses(run_dir)


@pytest.mark.slow
def test_a_host_lost_for_good_is_excluded_and_the_run_finishes_on_the_rest(tmp_path, full):
    hosts, run_dir = tmp_path / "hosts", tmp_path / "run"
    hosts.write_text("0\n1\n")
    proc = launch("--hosts-file", hosts, "--host-deadline", "1",
                  train_flags=("--mesh", "dp=2,fsdp=4", "--run-dir", run_dir))
    lines: list[str] = []
    try:
        read_until(proc, "] step 5/8", lines)  # between checkpoints (every 2 steps)
        hosts.write_text("0\n")  # host 1 is gone: the operator (or a health check) says so
        os.kill(pid_of(lines, 1), signal.SIGKILL)
        killed, at = time.monotonic(), max(int(x.split("step ")[1].split("/")[0])
                                           for x in lines if "] step " in x)
        resumed = read_until(proc, "resuming from step", lines)
        compiled = read_until(proc, "compiled train step in", lines)
        read_until(proc, "] step ", lines)  # the first step trained on 4 devices
        back = time.monotonic() - killed
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 0, out + err
    assert ("[launch] host 1 failed and not back in" in resumed and "within 1 s: excluded; "
            "re-planned dp=2,fsdp=4 (--grad-accum 1) -> fsdp=4 with --grad-accum 2 on 4 "
            "devices (1 host)" in resumed), resumed
    step = int(resumed.split("resuming from step ")[1])
    assert f"restored step {step}" in out and "all processes finished" in out
    print(f"\nelastic: killed at step {at}, training again {back:.1f} s later from step "
          f"{step} ({at - step} steps redone); {compiled.split('] ')[1].strip()}")
    # The reference switched meshes at the same step, on one process: fsdp=4, grad-accum 2.
    switched = tmp_path / "switched"
    train(TrainConfig.of(**SHAPE, mesh="fsdp=4", grad_accum=2, run_dir=str(switched),
                         resume=str(full[0] / "checkpoints" / str(step))))
    expected = {**{s: full[1][s] for s in range(1, step + 1)}, **losses(switched)}
    assert close(losses(run_dir), expected)


@pytest.mark.slow
def test_a_host_listed_again_is_taken_back_at_the_next_checkpoint(tmp_path, full):
    hosts, run_dir = tmp_path / "hosts", tmp_path / "run"
    hosts.write_text("0\n")  # host 1 is not there yet: start on host 0 alone
    # Half a second a step: the launcher (reading the file each second) sees host 1 return
    # well before the run ends.
    proc = launch("--hosts-file", hosts, train_flags=(
        "--mesh", "dp=2,fsdp=4", "--run-dir", run_dir, "--inject-straggler", "0:0.5"))
    lines: list[str] = []
    try:
        first = read_until(proc, "excluded", lines)
        read_until(proc, "checkpoint: saved step 2", lines)
        hosts.write_text("0\n1\n")
        grow = read_until(proc, "available again", lines)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 0, out + err
    assert "host 1 not listed in" in first and "-> fsdp=4 with --grad-accum 2" in first
    assert ("host 1 available again; re-planned fsdp=4 (--grad-accum 2) -> dp=2,fsdp=4 with "
            "--grad-accum 1 on 8 devices (2 hosts) at the next checkpoint") in grow, grow
    assert "restarting on the new layout from step" in out and "started process 1" in out
    # The layouts agree on every step's loss (a dense model's micro-batching changes only
    # the order of a sum).
    assert close(losses(run_dir), full[1])


def test_the_health_checks_lines_flag_their_process():
    """The launcher reads the lines the training code prints: made here by that code."""
    from jdist.train.health import Mismatch
    from jdist.train.straggler import Detector

    watch = Watch()
    watch("[p0] checkpoint: saved step 2 to runs/x/checkpoints/2 (1.12 MiB) in 0.3s\n")
    detector = Detector(every=2, threshold=1.5, windows=1, names=["a", "b", "c"])
    watch("[p0] " + detector.message({"process": 2, "host": "c", "seconds": 0.5,
                                      "median_s": 0.1, "ratio": 5.0}))
    odd = Mismatch("params/embed", (5,), (1,), ("dp=3",), 4, majority=True)
    tie = Mismatch("params/embed", (1, 5), (0, 1), ("dp=0", "dp=1"), 2, majority=False)
    watch("[p0] jdist: error: step 3: " + tie.message())  # no majority: nobody is blamed
    assert (watch.saves, watch.flag("straggling"), watch.flag("silent data corruption")) == (
        1, 2, None)
    watch("[p1] jdist: error: step 3: " + odd.message())
    assert watch.flag("silent data corruption") == 1
    # The group then exits 4 (every process); process 0 happened to exit first, but the
    # host excluded is the one the replicas outvoted.
    elastic = Elastic(HostTable(2), original_layout({"data": 2, "fsdp": 4}, 1, hosts=2), 4)
    assert elastic.failed([0, 1], 0, watch, print) == (
        "host 1 flagged for silent data corruption: excluded; re-planned dp=2,fsdp=4 "
        "(--grad-accum 1) -> fsdp=4 with --grad-accum 2 on 4 devices (1 host)")
    assert elastic.hosts() == [0]


@pytest.mark.slow
def test_a_straggler_is_excluded_at_the_next_checkpoint(tmp_path, full):
    run_dir = tmp_path / "run"
    # A window of 2 steps at 3x the other's host time: the first steps' noise on a loaded
    # machine (process 0 writing the metrics) does not make process 0 look that slow. Found
    # at step 4 at the latest; a checkpoint every step leaves steps to restart for.
    proc = launch("--exclude-stragglers", train_flags=(
        "--mesh", "dp=2,fsdp=4", "--run-dir", run_dir, "--inject-straggler", "1:1.0",
        "--straggler-every", "2", "--straggler-windows", "1", "--straggler-threshold", "3",
        "--checkpoint-every", "1"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert ("[launch] host 1 flagged as a straggler: excluded; re-planned dp=2,fsdp=4 "
            "(--grad-accum 1) -> fsdp=4 with --grad-accum 2 on 4 devices (1 host) at the next "
            "checkpoint") in out, out
    assert "restarting on the new layout from step" in out, out
    assert close(losses(run_dir), full[1])
