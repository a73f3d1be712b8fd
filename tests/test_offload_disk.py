"""`--offload disk`: the optimizer's moments in files, read, updated and written back a
layer at a time (`jdist.step.disk_update`); equal to one device, the moments really in the
files, and what it cannot run refused in one line."""

import re

import jax
import numpy as np
import pytest

from jdist import checkpoint as ckpt
from jdist.config import TrainConfig
from jdist.errors import ConfigError
from jdist.models import get_preset
from jdist.step import moment_files
from jdist.step.from_flags import plan_for
from jdist.tools.equivalence import assert_matches, config, train_steps
from jdist.train.__main__ import main
from jdist.train.loop import train
from jdist.train.resume import start_state

TINY = get_preset("tiny")


def test_moments_on_disk_match_single_device(corpus, single_device, tmp_path):
    """fsdp=2,tp=2: loss, grad_norm and first-step gradients equal one device at 1e-5; the
    parameters after step 2 (the moments of step 1 read back from their files) bitwise
    those of the whole-tree update on the same mesh; the files hold the moments."""
    run = train_steps(TINY, "fsdp=2,tp=2", corpus.train,
                      config(offload="disk", offload_dir=str(tmp_path), steps=2))
    assert_matches(run, single_device(TINY, steps=2))
    whole = train_steps(TINY, "fsdp=2,tp=2", corpus.train, config(steps=2))
    for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(a, b)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 * len(jax.tree.leaves(run.params)), files  # mu and nu per leaf
    nu = np.load(tmp_path / next(f for f in files if "nu.blocks.attn.wq" in f))
    assert nu.shape == (TINY.n_layers, 64, 8, 8) and nu.min() >= 0 and nu.max() > 0


@pytest.mark.parametrize("flags, what", [
    ({"mesh": "pp=2,fsdp=2", "n_layers": 4}, "--mesh with pp"),
    ({"optimizer": "muon"}, "--optimizer muon"),
    ({"on_nan": "skip"}, "--on-nan skip"),
    ({"lora_rank": 4}, "LoRA")])
def test_what_disk_offload_cannot_run_is_refused(flags, what):
    with pytest.raises(ConfigError, match=f"--offload disk does not run with {re.escape(what)}"):
        plan_for(TrainConfig.of(**{"model": "tiny", "mesh": "fsdp=2", "offload": "disk",
                                   **flags}))


def test_refusal_is_one_line_and_exit_2(capsys, tmp_path):
    code = main(["--model", "tiny", "--mesh", "fsdp=2", "--offload", "disk", "--optimizer",
                 "muon", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--offload disk does not run with" in err[0], err


def test_resume_carries_the_moments(tmp_path):
    """Saved at step 2 under --offload disk on fsdp=2,tp=2 and resumed there: steps 3 and 4
    repeat bitwise (step 4's update reads the moments the checkpoint carried). The last
    checkpoint, restored for dp=2,tp=2, rewrites the files bitwise as the run left them."""
    common = dict(model="tiny", batch_size=8, seq_len=32, warmup=2, eval_every=0,
                  log_every=100, steps=4, offload="disk")
    losses = lambda history: {r["step"]: r["loss"] for r in history if r["step"] > 2}
    first = losses(train(TrainConfig.of(**common, mesh="fsdp=2,tp=2", checkpoint_every=2,
                                        run_dir=str(tmp_path / "a"))))
    again = losses(train(TrainConfig.of(**common, mesh="fsdp=2,tp=2",
                                        resume=str(tmp_path / "a" / "checkpoints" / "2"),
                                        run_dir=str(tmp_path / "b"))))
    assert again == first and sorted(first) == [3, 4], (first, again)
    plan = plan_for(TrainConfig.of(**common, mesh="dp=2,tp=2"))[1]
    found = ckpt.resolve_explicit(str(tmp_path / "a" / "checkpoints" / "4"), full=False)
    start_state(plan, 0, found, offload_dir=tmp_path / "c")
    left = sorted((tmp_path / "a" / moment_files.DIR_NAME).iterdir())
    assert [p.name for p in left] == sorted(p.name for p in (tmp_path / "c").iterdir())
    for path in left:
        np.testing.assert_array_equal(np.load(path), np.load(tmp_path / "c" / path.name))
