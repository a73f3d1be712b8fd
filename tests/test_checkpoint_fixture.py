"""Checkpoints written before issue 30 still resume: tests/fixtures/checkpoint_v1/ is a run
directory saved by the old code (see tests/fixtures/make_checkpoint_fixture.py; never
regenerate it to make this test pass), resumed here with the CLI onto other meshes; the
resumed steps must log the losses the original run logged for them (step 4: what the
learning-rate schedule of issue 46 gives it; expected.json's losses_note)."""

import json
import shutil
from pathlib import Path

import pytest

from jdist import checkpoint as ckpt
from jdist.train.__main__ import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_v1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
SAVED = EXPECTED["saved_step"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_losses(records: list[dict]) -> None:
    got = {str(r["step"]): r["loss"] for r in records}
    assert sorted(got, key=int) == sorted(EXPECTED["losses"], key=int), got
    for step, want in EXPECTED["losses"].items():
        # Another mesh sums in another order: equal up to rounding, not bitwise.
        assert got[step] == pytest.approx(want, rel=1e-5), (step, got[step], want)


def test_the_fixture_is_intact():
    """The committed bytes are the ones the old code wrote (sizes and sha256s)."""
    path = FIXTURE / "checkpoints" / str(SAVED)
    assert ckpt.validate(path, full=True) is None
    assert json.loads((path / ckpt.MANIFEST).read_text())["format"] == \
        "jdist-checkpoint-manifest/2"
    assert ckpt.read_meta(path)["step"] == SAVED


def test_resume_auto_continues_the_old_run_on_another_mesh(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    monkeypatch.chdir(run)  # --data corpus.txt is relative to the run directory
    assert main([*EXPECTED["flags"], "--mesh", "dp=2", "--run-dir", "."]) == 0
    out = capsys.readouterr().out
    assert f"restored step {SAVED} from" in out, out
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, len(EXPECTED["losses"]) + SAVED + 1))
    check_losses(records[SAVED:])


def test_resume_path_starts_a_new_run_from_the_old_checkpoint(tmp_path, monkeypatch, capsys):
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    monkeypatch.chdir(old)
    new = tmp_path / "new"
    argv = [*EXPECTED["flags"], "--mesh", "fsdp=1", "--run-dir", str(new),
            "--resume", str(old / "checkpoints" / str(SAVED)), "--verify-checkpoint", "full",
            "--checkpoint-every", "1"]
    assert main(argv) == 0
    assert f"restored step {SAVED} from" in capsys.readouterr().out
    check_losses(metrics(new))
    # Its own checkpoints are good and name the old run's data and model.
    steps = [s for s, _ in ckpt.step_dirs(new / "checkpoints")]
    assert steps[-1] == max(map(int, EXPECTED["losses"]))
    last = new / "checkpoints" / str(steps[-1])
    assert ckpt.validate(last, full=True) is None
    assert ckpt.read_meta(last)["data_fingerprint"] == \
        ckpt.read_meta(old / "checkpoints" / str(SAVED))["data_fingerprint"]
