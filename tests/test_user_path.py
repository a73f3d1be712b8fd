"""The user's path from one command to the next (issue 29): a run ends with a checkpoint,
a finished run is extended by more steps, and train -> generate -> export -> generate ->
extend -> export runs end to end on the tiny model and the Hugging Face fixture."""

import json

import jax
import pytest

from jdist import checkpoint as ckpt
from jdist.step.optim import lr_schedule
from jdist.train.__main__ import main as train_main

TINY = ["--model", "tiny", "--mesh", "dp=1", "--batch-size", "2", "--seq-len", "32",
        "--eval-every", "0", "--warmup", "1", "--lr", "1e-2"]


@pytest.fixture(autouse=True, scope="module")
def eight_devices():
    """The in-process commands simulate only the devices their mesh needs if JAX is not up
    yet (`jdist.runtime.distributed.configure_devices`): start it with conftest's 8 first, or the
    tests that follow in this worker would find one device."""
    assert len(jax.devices()) == 8


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


def test_step_1_of_a_warmup_trains(tmp_path):
    """The warmup starts at lr / warmup, not at 0 (issue 46: step 1 once trained at lr 0):
    each step logs the learning rate its update applied (tests/test_checkpoint.py)."""
    run_dir = tmp_path / "run"
    assert train_main([*TINY, "--steps", "4", "--warmup", "2", "--no-final-checkpoint",
                       "--run-dir", str(run_dir)]) == 0
    lrs = [r["lr"] for r in metrics(run_dir)]
    assert lrs[:2] == pytest.approx([5e-3, 1e-2], rel=1e-6) and lrs[2] < 1e-2, lrs
    # --warmup 0 and 1 both start at the peak (float32: 1e-2 to rounding).
    assert float(lr_schedule(1e-2, 4, 0)(0)) == float(lr_schedule(1e-2, 4, 1)(0)) == \
        pytest.approx(1e-2)


def test_the_user_path_end_to_end(tmp_path, capsys):
    """train with LoRA -> generate from the checkpoint -> export merged -> generate from the
    export (--init-from) the same greedy text -> extend the run by 10 steps -> export again.
    The tiny model with the Hugging Face fixture's tokenizer (its vocabulary: every id the
    model can generate decodes), so the export carries an HF tokenizer and its ids."""
    from pathlib import Path

    from safetensors.numpy import load_file

    from jdist import data
    from jdist.export import main as export
    from jdist.generate.__main__ import main as generate

    tokenizer = Path(__file__).parent / "fixtures" / "hf" / "tokenizer"
    corpus, run = tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_bytes(data.builtin_text(1 << 15))  # not the whole stdlib: tokenized here
    flags = [*TINY, "--vocab-size", "320", "--tokenizer", str(tokenizer), "--data",
             str(corpus), "--lora-rank", "4", "--run-dir", str(run)]
    prompt = ["--prompt", "def f(x):", "--max-new-tokens", "8"]

    assert train_main([*flags, "--steps", "2"]) == 0
    capsys.readouterr()
    assert generate(["--checkpoint", str(run), *prompt]) == 0  # adapters on the seed's base
    text = capsys.readouterr().out
    assert text.startswith("def f(x):") and len(text) > len("def f(x):\n")

    merged = tmp_path / "merged"
    assert export([str(run), "--hf", str(merged), "--merge-lora"]) == 0
    assert (merged / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    config = json.loads((merged / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (315, 316)  # the tokenizer's
    capsys.readouterr()
    assert generate(["--init-from", str(merged), *prompt]) == 0
    assert capsys.readouterr().out == text

    assert train_main([*flags, "--steps", "12"]) == 0
    assert "extending the run from --steps 2 to 12" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run)] == list(range(1, 13))
    again = tmp_path / "merged-12"
    assert export([str(run), "--hf", str(again), "--merge-lora"]) == 0
    assert "exported step 12" in capsys.readouterr().out
    before, after = (load_file(next(d.glob("*.safetensors"))) for d in (merged, again))
    assert sorted(before) == sorted(after)
    assert any((before[k] != after[k]).any() for k in before)  # 10 more steps moved them
