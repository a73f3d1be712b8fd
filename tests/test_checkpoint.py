"""Checkpoints in one process: bitwise resume, elastic resume onto other meshes, corrupt
checkpoints, mismatched runs, and the three `--on-nan` policies (with an injected NaN)."""

import json
import shutil

import pytest

from jdist import checkpoint as ckpt
from jdist.config import TrainConfig
from jdist.errors import ConfigError
from jdist.step.optim import lr_schedule
from jdist.train import resume
from jdist.train.__main__ import main
from jdist.train.loop import train

TINY = {"model": "tiny", "batch_size": 8, "seq_len": 32, "warmup": 2, "eval_every": 0,
        "log_every": 100}


def config(run_dir, **kw) -> TrainConfig:
    return TrainConfig.of(**{**TINY, **kw, "run_dir": str(run_dir)})


def losses(history, after: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history if r["step"] > after}


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """20 uninterrupted steps on dp=8, checkpoints every 5."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    history = train(config(run_dir, mesh="dp=8", steps=20, checkpoint_every=5, keep=4))
    return run_dir, losses(history)


def test_checkpoints_are_complete_and_pruned(ref):
    run_dir, _ = ref
    steps = [s for s, _ in ckpt.step_dirs(run_dir / "checkpoints")]
    assert steps == [5, 10, 15, 20]
    for _, path in ckpt.step_dirs(run_dir / "checkpoints"):
        assert ckpt.validate(path) is None
        meta = ckpt.read_meta(path)
        assert meta["data_position"] == meta["step"] and meta["rng"] == {"seed": 0}
        assert meta["config"]["mesh"] == "dp=8" and meta["model"]["d_model"] == 64
        # Orbax's array format, never a pickle.
        assert not any(p.suffix in (".pkl", ".pickle") for p in path.rglob("*"))


def test_resume_is_bitwise_on_the_same_mesh(ref, tmp_path):
    run_dir, full = ref
    history = train(config(tmp_path / "r", mesh="dp=8", steps=20,
                           resume=str(run_dir / "checkpoints" / "10")))
    resumed = losses(history)
    assert sorted(resumed) == list(range(11, 21))
    assert resumed == {s: full[s] for s in range(11, 21)}  # bitwise


def test_elastic_resume_both_ways(ref, tmp_path):
    """dp=8 -> fsdp=4,tp=2 from step 10, then fsdp=4,tp=2 -> dp=8 from step 15."""
    run_dir, full = ref
    tp_dir = tmp_path / "tp"
    tp = losses(train(config(tp_dir, mesh="fsdp=4,tp=2", steps=20, checkpoint_every=5,
                             resume=str(run_dir / "checkpoints" / "10"))))
    assert ckpt.read_meta(tp_dir / "checkpoints" / "15")["mesh"]["tensor"] == 2
    back = losses(train(config(tmp_path / "dp", mesh="dp=8", steps=20,
                               resume=str(tp_dir / "checkpoints" / "15"))))
    assert sorted(tp) == list(range(11, 21)) and sorted(back) == list(range(16, 21))
    for step, loss in [*tp.items(), *back.items()]:
        assert abs(loss - full[step]) <= 1e-5 * abs(full[step]), (step, loss, full[step])


def test_elastic_resume_onto_zero3(ref, tmp_path):
    run_dir, full = ref
    hsdp = losses(train(config(tmp_path / "h", mesh="dp=2", zero=3, steps=20,
                               resume=str(run_dir / "checkpoints" / "15"))))
    assert sorted(hsdp) == list(range(16, 21))
    for step, loss in hsdp.items():
        assert abs(loss - full[step]) <= 1e-5 * abs(full[step])


def corrupt_copy(ref, tmp_path, how: str):
    run_dir = tmp_path / "run"
    shutil.copytree(ref[0], run_dir)
    newest = run_dir / "checkpoints" / "20"
    victim = max((p for p in (newest / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)  # the largest array data file
    if how == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif how == "delete":
        victim.unlink()
    elif how == "tamper":  # same size, one byte changed
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
    elif how == "no-manifest":  # killed between Orbax's commit and the manifest
        (newest / ckpt.MANIFEST).unlink()
    return run_dir, newest


@pytest.mark.parametrize("how", ["truncate", "delete", "no-manifest"])
def test_corrupt_newest_is_detected(ref, tmp_path, how, capsys):
    run_dir, newest = corrupt_copy(ref, tmp_path, how)
    assert ckpt.validate(newest) is not None
    # An explicit PATH: one line, exit 2, nothing trained.
    code = main(["--model", "tiny", "--mesh", "dp=8", "--steps", "20", "--batch-size", "8",
                 "--seq-len", "32", "--warmup", "2", "--run-dir", str(tmp_path / "other"),
                 "--resume", str(newest)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("jdist: error: --resume "), err
    assert "not usable" in err[0] and not (tmp_path / "other").exists()
    # auto: falls back to step 15 and moves the bad one aside.
    found = resume.find(config(run_dir, mesh="dp=8", steps=20), ref_model(), run_dir)
    assert found.step == 15
    assert "falling back" in capsys.readouterr().out
    assert not newest.exists() and any((run_dir / "checkpoints.bad").iterdir())


def test_same_size_tampering_is_found_by_default(ref, tmp_path):
    """A flipped byte keeps every size, and Orbax restores it as it is (its array files carry
    no checksum): resuming re-hashes every file by default and falls back; `full=False`
    (--verify-checkpoint size) only stats. An explicit PATH never falls back."""
    run_dir, newest = corrupt_copy(ref, tmp_path, "tamper")
    root = run_dir / "checkpoints"
    assert ckpt.validate(newest) is None and ckpt.latest_good(root, full=False).step == 20
    assert "does not match its recorded sha256" in ckpt.validate(newest, full=True)
    found = ckpt.latest_good(root)
    assert found.step == 15 and found.skipped[0][0] == newest
    with pytest.raises(ConfigError, match="not usable: file .* sha256"):
        ckpt.resolve_explicit(str(newest))
    assert ckpt.resolve_explicit(str(root), full=False).step == 20


def test_generate_refuses_a_tampered_checkpoint_in_one_line(ref, tmp_path, capfd):
    from jdist.generate.__main__ import main as generate_main

    run_dir, newest = corrupt_copy(ref, tmp_path, "tamper")
    capfd.readouterr()
    code = generate_main(["--checkpoint", str(run_dir), "--prompt", "def",
                          "--max-new-tokens", "2"])  # in process: a new one costs ~3 s
    out, stderr = capfd.readouterr()
    err = stderr.strip().splitlines()
    assert code == 2 and len(err) == 1, stderr
    assert err[0].startswith(f"jdist: error: --checkpoint {run_dir}: checkpoint is not usable")
    assert "sha256" in err[0] and str(run_dir / "checkpoints" / "15") in err[0]  # the way out
    assert out == ""


def ref_model():
    from jdist.models import get_preset

    return get_preset("tiny")


def test_auto_falls_back_and_completes_the_run(ref, tmp_path, capsys):
    """A flipped byte in the newest checkpoint, default flags: one line says so, the run
    resumes from the one before and reproduces the uninterrupted run bitwise."""
    run_dir, newest = corrupt_copy(ref, tmp_path, "tamper")
    history = train(config(run_dir, mesh="dp=8", steps=20, checkpoint_every=5, keep=4))
    said = [x for x in capsys.readouterr().out.splitlines()
            if str(newest) in x and "saved step" not in x]
    assert len(said) == 1 and "sha256" in said[0] and "falling back" in said[0], said
    assert losses(history) == {s: ref[1][s] for s in range(16, 21)}
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 21))
    assert ckpt.validate(newest) is None  # saved again, good this time


def test_resume_refuses_a_different_computation(ref, tmp_path):
    run_dir, _ = ref
    with pytest.raises(ConfigError, match="--seed 0 but this run has --seed 1"):
        resume.find(config(run_dir, mesh="fsdp=8", steps=20, seed=1), ref_model(), run_dir)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        resume.find(config(run_dir, mesh="dp=8", steps=20, resume="none"), ref_model(), run_dir)


NAN = {"mesh": "dp=2", "steps": 8, "checkpoint_every": 2, "inject_nan_at_step": 3}


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory):
    """The same run with a NaN injected at step 3, under --on-nan skip and rollback."""
    root = tmp_path_factory.mktemp("nan")
    return (train(config(root / "skip", on_nan="skip", **NAN)),
            train(config(root / "rb", on_nan="rollback", **NAN)), root)


def test_on_nan_skip_and_rollback_agree(nan_runs):
    skip, rollback, root = nan_runs
    assert [r.get("skipped", False) for r in skip] == [False, False, True] + [False] * 5
    assert skip[2]["loss"] != skip[2]["loss"]  # the injected step really was NaN
    assert [r["nonfinite_steps"] for r in skip] == [0, 0] + [1] * 6
    # Rolled back to step 2, replayed, passed over batch 3: the same result as skipping it.
    assert [r["step"] for r in rollback] == list(range(1, 9))
    assert rollback[2]["skipped"] and rollback[-1]["nonfinite_steps"] == 1
    for a, b in zip(skip[3:], rollback[3:]):
        assert a["loss"] == a["loss"] and abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"])
    assert [r["step"] for r in metrics(root / "rb")] == list(range(1, 9))


def test_reported_lr_is_the_applied_lr(nan_runs):
    """A skipped step is not an optimizer step under either policy: the schedule does not
    advance over it, and `lr` reports the rate each update applied."""
    skip, rollback, _ = nan_runs
    schedule = lr_schedule(TrainConfig().optim.lr, NAN["steps"], TINY["warmup"])
    updates_before = [0, 1, 2, 2, 3, 4, 5, 6]  # step 3 (the NaN) applied no update
    expected = [float(schedule(n)) for n in updates_before]
    assert [r["lr"] for r in skip] == pytest.approx(expected, rel=1e-6)
    assert [r["lr"] for r in rollback[3:]] == pytest.approx(expected[3:], rel=1e-6)


def test_on_nan_stop_exits_3_without_saving_the_bad_state(tmp_path, capsys):
    run_dir = tmp_path / "stop"
    argv = ["--model", "tiny", "--mesh", "dp=2", "--steps", "8", "--batch-size", "8",
            "--seq-len", "32", "--warmup", "2", "--eval-every", "0", "--checkpoint-every", "2",
            "--inject-nan-at-step", "3", "--on-nan", "stop", "--run-dir", str(run_dir)]
    assert main(argv) == 3
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("jdist:")]
    assert len(err) == 1 and "step 3: loss nan" in err[0] and "--on-nan stop" in err[0]
    assert [s for s, _ in ckpt.step_dirs(run_dir / "checkpoints")] == [2]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


def test_interleaved_layer_order_moves_both_ways(tmp_path):
    """An interleaved pipeline stores the layer stack permuted (stage s holds chunks s, s+P);
    its checkpoints record that order and resume onto a plain mesh and back, and onto the
    V shape's order (stage s holds chunks s and 2P-1-s)."""
    deep = {"n_layers": 4, "steps": 15, "checkpoint_every": 5}
    interleaved = {"mesh": "pp=2", "pp_schedule": "interleaved", "pp_virtual_stages": 2,
                   "microbatches": 4}
    full = losses(train(config(tmp_path / "a", **deep, **interleaved)))
    assert ckpt.read_meta(tmp_path / "a" / "checkpoints" / "5")["layer_order"] == [0, 2, 1, 3]
    plain = losses(train(config(tmp_path / "b", **deep, mesh="dp=2",
                                resume=str(tmp_path / "a" / "checkpoints" / "5"))))
    assert ckpt.read_meta(tmp_path / "b" / "checkpoints" / "10")["layer_order"] == [0, 1, 2, 3]
    back = losses(train(config(tmp_path / "c", **deep, **interleaved,
                               resume=str(tmp_path / "b" / "checkpoints" / "10"))))
    vee = losses(train(config(tmp_path / "d", **deep, mesh="pp=2", pp_schedule="zbv",
                              microbatches=4, resume=str(tmp_path / "b" / "checkpoints" / "10"))))
    assert ckpt.read_meta(tmp_path / "d" / "checkpoints" / "15")["layer_order"] == [0, 3, 1, 2]
    assert sorted(plain) == list(range(6, 16)) and sorted(back) == sorted(vee) == list(
        range(11, 16))
    for step, loss in [*plain.items(), *back.items(), *vee.items()]:
        assert abs(loss - full[step]) <= 1e-5 * abs(full[step]), (step, loss, full[step])


def test_saves_only_go_forward(tmp_path):
    """The same step again is skipped only if it is really there; an older one is one line."""
    import jax.numpy as jnp

    root, state = tmp_path / "checkpoints", {"w": jnp.arange(4.0)}
    saver = ckpt.Checkpointer(root)
    saver.save(2, state, {"step": 2})
    saver.save(2, state, {"step": 2})  # e.g. the final save right after a periodic one
    saver.close()
    (root / "2").rename(tmp_path / "set-aside")  # as a rollback does with a bad checkpoint
    saver.save(2, state, {"step": 2})  # saved again, not skipped
    saver.close()
    assert ckpt.validate(root / "2") is None
    other = ckpt.Checkpointer(root)  # e.g. a second run in the same --run-dir
    with pytest.raises(ConfigError, match="cannot save step 1 .* already holds step 2"):
        other.save(1, state, {"step": 1})
    other.close()


def test_rollback_after_resuming_from_elsewhere_restores_that_checkpoint(ref, tmp_path, capsys):
    """Nothing saved in this run dir yet: a rollback goes back to the checkpoint the run
    resumed from, not to step 0."""
    run_dir, full = ref
    history = train(config(tmp_path / "r", mesh="dp=8", steps=20, on_nan="rollback",
                           inject_nan_at_step=12, resume=str(run_dir / "checkpoints" / "10")))
    assert "rolled back to step 10" in capsys.readouterr().err
    assert [r["step"] for r in history] == list(range(11, 21)) and history[1]["skipped"]
    assert history[0]["loss"] == full[11]


def test_manifests_are_validated_under_python_O(tmp_path):
    """Validation is written without `assert`, so optimised Python still refuses a bad
    manifest."""
    import subprocess
    import sys

    step = tmp_path / "7"
    step.mkdir()
    (step / ckpt.MANIFEST).write_text(json.dumps({"format": "not-ours", "files": {"x": {}}}))
    code = f"from jdist import checkpoint as c; from pathlib import Path; " \
           f"print(c.validate(Path({str(step)!r})))"
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "unreadable" in out, out
