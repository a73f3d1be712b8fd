"""Slurm for real (`.ci/slurm-up.sh` starts a one-node Slurm; CI runs it before the tests):
the sbatch script `python -m jdist.plan --emit slurm` writes, submitted as 2 tasks (standing
for 2 hosts, 4 simulated CPU devices each, the plan's dp=2,fsdp=4 over all 8), trains through
`jax.distributed`'s own Slurm detection; `scontrol requeue` mid-run stops it (SIGTERM: a
checkpoint of the current step) and Slurm runs it again under the same job id, which
resumes from that checkpoint and ends with the losses of one uninterrupted run."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jdist.config import parse_args
from jdist.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["--model", "tiny", "--devices", "8", "--hosts", "2", "--accelerator", "cpu-sim",
        "--batch-size", "8", "--seq-len", "32", "--fix", "dp=2,fsdp=4"]
EXTRA = ["--steps", "30", "--checkpoint-every", "5", "--log-every", "1", "--eval-every", "0"]
REQUEUE_AFTER = 8  # steps: after the checkpoint of step 5, well before the end
TIMEOUT_S = 900
PREEMPTED = "SIGTERM received: saved a checkpoint at step "  # jdist.train.faults.Preempted


def slurm_state() -> str:
    """This node's state, or why there is none, in words."""
    if not shutil.which("sinfo"):
        return "sinfo is not installed"
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                          timeout=30)
    return (done.stdout.strip() or done.stderr.strip() or "no node").splitlines()[0]


def scontrol_job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def wait_for(condition, what: str, job: str, output: Path) -> float:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            pytest.fail(f"timed out waiting for {what}; job {job} "
                        f"{scontrol_job(job).get('JobState')}:\n{output.read_text()[-3000:]}")
        time.sleep(0.5)
    return time.monotonic()


def logged_steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+)/", text, re.MULTILINE)]


@pytest.mark.slow
def test_requeued_job_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path):
    state = slurm_state()
    if not state.startswith(("idle", "mixed", "allocated")):
        pytest.fail(f"Slurm is not running here ({state}); start it: sudo .ci/slurm-up.sh")
    script = tmp_path / "train.sbatch"
    emitted = subprocess.run([sys.executable, "-m", "jdist.plan", *PLAN, "--emit", "slurm",
                              "--out", str(script)], capture_output=True, text=True,
                             timeout=300, cwd=ROOT)
    assert emitted.returncode == 0, emitted.stderr
    # The script's own train command, for the uninterrupted reference below.
    line = next(x for x in script.read_text().splitlines() if x.startswith("srun "))
    planned = shlex.split(line.split(" --run-dir")[0])[4:]
    assert planned[:2] == ["--model", "tiny"] and "dp=2,fsdp=4" in planned

    run_dir = tmp_path / "run"
    env = {**os.environ, "JDIST_RUN_DIR": str(run_dir), "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    # One node here: its 2 tasks stand for the script's 2 nodes (command-line options
    # override the script's #SBATCH lines).
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2",
                          f"--chdir={tmp_path}", str(script), *EXTRA], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    output = tmp_path / f"jdist-tiny-{job}.out"
    text = lambda: output.read_text() if output.exists() else ""
    wait_for(lambda: max(logged_steps(text()), default=0) >= REQUEUE_AFTER,
             f"step {REQUEUE_AFTER}", job, output)
    requeued_at = time.monotonic()
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    second = lambda: text().partition(PREEMPTED)[2]  # the second run's output, after the
    # line the first run's SIGTERM handler printed
    wait_for(lambda: second(), "the preemption checkpoint", job, output)
    resumed_at = wait_for(lambda: logged_steps(second()), "training to start again", job,
                          output)
    wait_for(lambda: scontrol_job(job).get("JobState") in ("COMPLETED", "FAILED",
                                                           "CANCELLED", "TIMEOUT"),
             "the end of the job", job, output)
    info = scontrol_job(job)
    before, _, after = text().partition(PREEMPTED)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, after[-3000:])
    saved_step = int(after.split()[0])
    assert logged_steps(after)[0] == saved_step + 1, after[-3000:]
    print(f"requeue to training again: {resumed_at - requeued_at:.1f} s; steps lost: "
          f"{max(logged_steps(before)) - saved_step}")

    reference = tmp_path / "reference"
    train(parse_args([*planned, *EXTRA, "--run-dir", str(reference)]))
    losses = lambda d: {r["step"]: r["loss"] for r in
                        map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}
    got, want = losses(run_dir), losses(reference)
    assert got.keys() == want.keys() == set(range(1, 31))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), step
