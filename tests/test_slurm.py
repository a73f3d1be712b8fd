"""Slurm for real (`.ci/slurm-up.sh` starts a one-node Slurm; CI runs it before the tests):
the sbatch script `python -m jdist.plan --emit slurm` writes, submitted as 2 tasks (standing
for 2 hosts, 4 simulated CPU devices each, the plan's dp=2,fsdp=4 over all 8), trains through
`jax.distributed`'s own Slurm detection. It is stopped twice mid-run: by `scontrol requeue`
(an operator's requeue), then by `scancel --signal=TERM` (what `--signal` sends before the
time limit: the script requeues itself on exit 75). Each time every process saves the
current step; Slurm runs the job again under the same id, which resumes there and ends with
the losses of one uninterrupted run."""

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
STEPS = 30
EXTRA = ["--steps", str(STEPS), "--checkpoint-every", "5", "--log-every", "1",
         "--eval-every", "0"]
# (after this step, stop the job this way): well before the end, so the job is running.
STOPS = [(8, ["scontrol", "requeue"]), (16, ["scancel", "--signal=TERM"])]
TIMEOUT_S = 900
BANNER = "\nmesh: "  # process 0's first line of every run
PREEMPTED = re.compile(r"SIGTERM received: saved a checkpoint at step (\d+)")
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


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


def logged_steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+)/", text, re.MULTILINE)]


class Job:
    """A submitted job and its output file (both runs append to it: --open-mode=append)."""

    def __init__(self, job_id: str, output: Path):
        self.id, self.output = job_id, output

    def runs(self) -> list[str]:
        """The output of each run so far (a run starts with process 0's mesh banner)."""
        text = "\n" + (self.output.read_text() if self.output.exists() else "")
        return text.split(BANNER)[1:]

    def wait_for(self, condition, what: str) -> float:
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; job {self.id} "
                            f"{scontrol_job(self.id).get('JobState')}:\n"
                            f"{self.output.read_text()[-3000:]}")
            time.sleep(0.5)
        return time.monotonic()

    def wait_for_step(self, run: int, step: int) -> float:
        """Until run `run` (from 1) has logged `step` or a later one: the time then."""
        def reached() -> bool:
            runs = self.runs()
            return len(runs) >= run and max(logged_steps(runs[run - 1]), default=0) >= step
        return self.wait_for(reached, f"step {step} of run {run}")


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
    job_id = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2",
                             f"--chdir={tmp_path}", str(script), *EXTRA], env=env,
                            capture_output=True, text=True, timeout=60,
                            check=True).stdout.strip()
    job = Job(job_id, tmp_path / f"jdist-tiny-{job_id}.out")
    try:
        measured = []
        for n, (after, stop) in enumerate(STOPS, 1):
            job.wait_for_step(n, after)
            stopped_at = time.monotonic()
            subprocess.run([*stop, job.id], check=True, timeout=30)
            again_at = job.wait_for_step(n + 1, 1)
            measured.append(again_at - stopped_at)
        job.wait_for(lambda: scontrol_job(job.id).get("JobState") in DONE, "the job's end")
    finally:
        if scontrol_job(job.id).get("JobState") not in DONE:
            subprocess.run(["scancel", job.id], timeout=30)
    info, runs = scontrol_job(job.id), job.runs()
    assert (info["JobState"], info["Restarts"], len(runs)) == ("COMPLETED", "2", 3), \
        (info, runs[-1][-3000:])
    lost = []
    for stopped, resumed in zip(runs, runs[1:]):
        saved = int(PREEMPTED.search(stopped).group(1))
        assert logged_steps(resumed)[0] == saved + 1, resumed[-3000:]
        lost.append(max(logged_steps(stopped)) - saved)
    print(f"stop to training again: {', '.join(f'{s:.1f}' for s in measured)} s; "
          f"steps lost: {lost}")

    reference = tmp_path / "reference"
    train(parse_args([*planned, *EXTRA, "--run-dir", str(reference)]))
    losses = lambda d: {r["step"]: r["loss"] for r in
                        map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}
    got, want = losses(run_dir), losses(reference)
    assert got.keys() == want.keys() == set(range(1, STEPS + 1))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), step
