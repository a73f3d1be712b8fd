"""Real signals to a real `python -m jdist.train`: SIGTERM saves and exits 75; SIGKILL at a
random step, then `--resume auto`, ends exactly where the uninterrupted run ends."""

import json
import random
import signal
import subprocess
import sys
import time

import pytest

from jdist import checkpoint as ckpt
from jdist.config import TrainConfig
from jdist.train.loop import train

ARGS = ["--model", "tiny", "--mesh", "dp=2,fsdp=2,tp=2", "--batch-size", "8", "--seq-len", "32",
        "--warmup", "2", "--eval-every", "0", "--log-every", "1"]


def start(run_dir, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jdist.train", *ARGS, *extra,
                             "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(proc: subprocess.Popen, step: int) -> list[str]:
    seen = []
    for line in proc.stdout:  # progress is on stdout, errors on stderr: both, in order
        seen.append(line)
        if line.startswith(f"step {step}/"):
            return seen
    raise AssertionError(f"run ended before step {step}: {''.join(seen)}")


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_saves_the_current_step_and_exits_75(tmp_path):
    proc = start(tmp_path / "run", "--steps", "500")
    try:
        wait_for_step(proc, 3)
        proc.send_signal(signal.SIGTERM)
        err = proc.stdout.read()
        assert proc.wait(timeout=120) == 75, err
    finally:
        proc.kill()
    assert "SIGTERM received" in err and "saved a checkpoint at step" in err
    (step, path), = ckpt.step_dirs(tmp_path / "run" / "checkpoints")
    assert ckpt.validate(path) is None and 3 <= step < 500
    assert metrics(tmp_path / "run")[-1]["step"] == step  # the step it was on when stopped


def interrupt(proc: subprocess.Popen) -> tuple[int, float, str]:
    """SIGINT now: (exit status, seconds it took to exit, what it printed after)."""
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        rest = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    return proc.returncode, time.monotonic() - sent, rest


def test_ctrl_c_during_start_up_exits_130_at_once(tmp_path):
    """Ctrl-C while jax is imported (Python lost it in a gc callback: the run trained to the
    end, exit 0) and while the step compiles (the exit came seconds late, then segfaulted):
    status 130 within seconds, one line, nothing saved. Later, the step is saved (75)."""
    proc = start(tmp_path / "a", "--steps", "500")
    time.sleep(1.0)  # importing jax
    code, took, said = interrupt(proc)
    assert code == 130 and took < 5 and said.strip() == "jdist: interrupted", (code, took, said)
    proc = start(tmp_path / "b", "--steps", "500")
    seen = next((line for line in proc.stdout if line.startswith("data: ")), "")  # compiling
    code, took, said = interrupt(proc)
    assert seen and code == 130 and took < 5, (code, took, said)
    assert said.strip().splitlines()[-1] == "jdist: interrupted" and "Traceback" not in said
    assert not ckpt.step_dirs(tmp_path / "b" / "checkpoints")
    proc = start(tmp_path / "c", "--steps", "500")
    wait_for_step(proc, 2)
    code, _, said = interrupt(proc)
    assert code == 75 and "SIGINT received" in said and "saved a checkpoint at step" in said
    assert len(ckpt.step_dirs(tmp_path / "c" / "checkpoints")) == 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    config = TrainConfig.of(model="tiny", mesh="dp=2,fsdp=2,tp=2", batch_size=8, seq_len=32,
                            warmup=2, eval_every=0, steps=12,
                            run_dir=str(tmp_path_factory.mktemp("ref") / "run"))
    return train(config)[-1]["loss"]


@pytest.mark.parametrize("seed", [1])  # one random kill step (a second added 40 s)
def test_sigkill_then_resume_auto_finishes_identically(tmp_path, reference, seed):
    kill_at = random.Random(seed).randint(2, 10)
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--steps", "12", "--checkpoint-every", "3")
    try:
        wait_for_step(proc, kill_at)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    again = subprocess.run([sys.executable, "-m", "jdist.train", *ARGS, "--steps", "12",
                            "--checkpoint-every", "3", "--run-dir", str(run_dir)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13)), kill_at
    assert records[-1]["loss"] == reference  # bitwise: same mesh, same batches
