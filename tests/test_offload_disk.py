"""`--offload disk`: the optimizer's moments in files, read, updated and written back a
layer at a time (`jdist.step.disk_update`); equal to one device, the moments really in the
files, and what it cannot run refused in one line."""

import re

import jax
import numpy as np
import pytest

from jdist.config import TrainConfig
from jdist.errors import ConfigError
from jdist.models import get_preset
from jdist.step.from_flags import plan_for
from jdist.tools.equivalence import assert_matches, config, train_steps
from jdist.train.__main__ import main

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
