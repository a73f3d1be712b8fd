"""The user's path from one command to the next (issue 29): a run ends with a checkpoint,
a finished run is extended by more steps, and train -> generate -> export -> generate ->
extend -> export runs end to end on the tiny model and the Hugging Face fixture."""

import json

import pytest

from jdist import checkpoint as ckpt
from jdist.step.optim import lr_schedule
from jdist.train.__main__ import main as train_main

TINY = ["--model", "tiny", "--mesh", "dp=1", "--batch-size", "2", "--seq-len", "32",
        "--eval-every", "0", "--warmup", "1", "--lr", "1e-2"]


def steps_in(run_dir) -> list[int]:
    return [s for s, _ in ckpt.step_dirs(run_dir / "checkpoints")]


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_ends_with_a_checkpoint_unless_told_not_to(tmp_path, capsys):
    run_dir, bare = tmp_path / "run", tmp_path / "bare"
    assert train_main([*TINY, "--steps", "1", "--run-dir", str(run_dir)]) == 0
    assert steps_in(run_dir) == [1]  # no --checkpoint-every: the final save
    assert train_main([*TINY, "--steps", "1", "--no-final-checkpoint",
                       "--run-dir", str(bare)]) == 0
    assert steps_in(bare) == [] and (bare / "metrics.jsonl").is_file()
    capsys.readouterr()
    from jdist.generate.__main__ import main as generate

    # The hint names what is there (a run that saved none), not a directory that is not.
    assert generate(["--checkpoint", str(bare), "--prompt", "x"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert f"--checkpoint {bare}: that run saved no checkpoint" in err, err
    assert "RUN_DIR/checkpoints/100" not in err


def test_a_finished_run_says_so_at_once_and_is_extended_by_more_steps(tmp_path, capsys):
    finished = tmp_path / "run"
    assert train_main([*TINY, "--steps", "2", "--run-dir", str(finished)]) == 0
    capsys.readouterr()
    # The same command again: one line, before any data is read or step compiled.
    assert train_main([*TINY, "--steps", "2", "--run-dir", str(finished)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines() == [
        f"jdist: {finished / 'checkpoints' / '2'} is already at step 2 of --steps 2: nothing "
        "to train; pass --steps N above 2 to extend the run"]
    # --steps 4 extends it, and the schedule's total with it.
    assert train_main([*TINY, "--steps", "4", "--run-dir", str(finished)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("resume:")]
    assert "extending the run from --steps 2 to 4 at step 2" in line, line
    records = metrics(finished)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["lr"] == pytest.approx(float(lr_schedule(1e-2, 4, 1)(2)), rel=1e-6)
    assert steps_in(finished)[-1] == 4
    # Fewer steps than the run has done: one line, exit 2.
    assert train_main([*TINY, "--steps", "3", "--run-dir", str(finished)]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "is at step 4, past --steps 3; pass --steps 4 or more" in err, err
