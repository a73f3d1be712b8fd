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
from jdist.parallel.pipeline import PipelineConfig
from jdist.step import moment_files
from jdist.step.from_flags import plan_for
from jdist.tools.equivalence import assert_matches, config, train_steps
from jdist.train import fit
from jdist.train.__main__ import main
from jdist.train.loop import train
from jdist.train.resume import start_state

TINY, MOE = get_preset("tiny"), get_preset("moe-tiny")
TINY4 = get_preset("tiny", n_layers=4)  # two layers per stage at pp=2


def test_moments_on_disk_match_single_device(corpus, single_device, tmp_path):
    """AdamW, moe-tiny on dp=2,ep=2,tp=2 at ZeRO-2 (the experts' stacks walked a layer at a
    time): loss, grad_norm and first-step gradients equal one device at 1e-5; the
    parameters after step 3 (the moments of steps 1-2 read back from their files) bitwise
    those of the whole-tree update on the same mesh (jax 0.10.2); the files hold the
    moments. (fsdp=2,tp=2 and dp=2,fsdp=2,tp=2 at ZeRO-1 the same, by hand.)"""
    run = train_steps(MOE, "dp=2,ep=2,tp=2", corpus.train,
                      config(offload="disk", offload_dir=str(tmp_path), zero=2))
    assert_matches(run, single_device(MOE))
    whole = train_steps(MOE, "dp=2,ep=2,tp=2", corpus.train, config(zero=2))
    # Bitwise on jax 0.10.2; on jax 0.12 a few elements differ in the last bit from run to
    # run (expert weights by 3.7e-9, norm scales by one ulp; tiny on fsdp=2,tp=2: bitwise).
    exact = jax.__version__.startswith("0.10.")
    for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(whole.params)):
        np.testing.assert_allclose(a, b, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-8)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 * len(jax.tree.leaves(run.params)), files  # mu and nu per leaf
    nu = np.load(tmp_path / next(f for f in files if "nu.blocks.attn.wq" in f))
    assert nu.shape == (MOE.n_layers, 64, 8, 8) and nu.min() >= 0 and nu.max() > 0


@pytest.mark.parametrize("model, mesh, zero, pipeline", [
    (TINY, "dp=2,fsdp=2,tp=2", 3, None),
    (TINY4, "pp=2,fsdp=2", 1, PipelineConfig("1f1b", 4, 1))], ids=["dp-fsdp-tp-zero3", "pp2"])
def test_muon_on_disk_matches_single_device(corpus, single_device, tmp_path, model, mesh,
                                            zero, pipeline):
    """Muon's momentum (and AdamW's moments of the rest) in files, each layer's matrices
    orthogonalised alone: equal to one device at 1e-5. On pp=2 a group is one layer per
    stage (rows j and j + 2 of the stage-split stack), each stage gathering its next layer
    while one computes (--prefetch on); the files hold the stored stack."""
    run = train_steps(model, mesh, corpus.train, config(  # pp2 also prefetches layers
        optimizer="muon", zero=zero, offload="disk", offload_dir=str(tmp_path),
        prefetch="on" if pipeline else "auto"), pipeline=pipeline)
    assert_matches(run, single_device(model, optimizer="muon"))
    mu = np.load(next(tmp_path.glob("*muon*mu.blocks.attn.wq.npy")))
    assert mu.shape == (model.n_layers, 64, 8, 8) and np.abs(mu).max(axis=(1, 2, 3)).all()
    assert not list(tmp_path.glob("*adamw*blocks.attn.wq*"))  # a matrix has no AdamW moments


@pytest.mark.parametrize("flags, what", [
    ({"mesh": "pp=2,fsdp=2", "n_layers": 4, "pp_schedule": "interleaved",
      "pp_virtual_stages": 2}, "a pipeline schedule of several chunks per stage"),
    ({"on_nan": "skip"}, "--on-nan skip"),
    ({"lora_rank": 4}, "LoRA")])
def test_what_disk_offload_cannot_run_is_refused(flags, what):
    with pytest.raises(ConfigError, match=f"--offload disk does not run with {re.escape(what)}"):
        plan_for(TrainConfig.of(**{"model": "tiny", "mesh": "fsdp=2", "offload": "disk",
                                   **flags}))


def test_refusal_is_one_line_and_exit_2(capsys, tmp_path):
    code = main(["--model", "tiny", "--mesh", "fsdp=2", "--offload", "disk", "--on-nan",
                 "skip", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--offload disk does not run with" in err[0], err


def test_resume_carries_the_moments(tmp_path):
    """Muon under --offload disk (its momentum and AdamW's moments in files), saved at step
    2 on fsdp=2,tp=2 and resumed there: steps 3 and 4 repeat bitwise (step 4's update reads
    the state the checkpoint carried). The last checkpoint, restored for dp=2,tp=2,
    rewrites the files bitwise as the run left them."""
    common = dict(model="tiny", batch_size=8, seq_len=32, warmup=2, eval_every=0,
                  log_every=100, steps=4, offload="disk", optimizer="muon")
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


@pytest.mark.gpu_compiler
def test_auto_takes_the_disk_when_only_the_disk_fits(capsys):
    """For an H100 target only none and disk plan (the host-memory modes are refused with
    --target): under a budget below no offload's prediction and above the disk's (its
    moments off the device, one layer's during the update), auto takes the disk."""
    flags = dict(model="tiny", mesh="fsdp=2", batch_size=8, seq_len=32, target="h100-80gb")
    need = {}
    for mode in ("none", "disk"):
        trial = TrainConfig.of(**flags, offload=mode)
        need[mode] = fit.plan_breakdown(trial, plan_for(trial)[1]).total
    assert need["none"] > need["disk"], need
    for budget, chosen in [(need["none"], "none"), (need["none"] - 1, "disk")]:
        auto = TrainConfig.of(**flags, offload="auto", device_memory_gb=budget / 2**30)
        assert fit.resolve_offload(auto).memory.offload == chosen, (budget, need)
    assert "--offload auto: disk" in capsys.readouterr().out
