"""`--offload params` (parameters, gradients and optimizer state in host memory, each layer
streamed in by the layer loop, the update on the host) and `--offload auto`: equal to one
device, the state really in the host memory space of the compiled step, what it cannot run
refused in one line, and resumable onto another mesh."""

import re

import jax
import numpy as np
import pytest

from jdist import checkpoint as ckpt
from jdist.config import TrainConfig
from jdist.errors import ConfigError
from jdist.memory import lower_step, predict
from jdist.models import get_preset
from jdist.parallel.pipeline import PipelineConfig
from jdist.step.from_flags import plan_for
from jdist.tools.equivalence import assert_matches, config, plan_of, train_steps
from jdist.train import fit
from jdist.train.__main__ import main
from jdist.train.loop import train

TINY, MOE = get_preset("tiny"), get_preset("moe-tiny")
TINY4 = get_preset("tiny", n_layers=4)  # two layers per stage at pp=2
HOST = "S(5)"  # XLA's host memory space in a compiled layout


# Also equal (run by hand, not kept for the suite's time): dp=2,fsdp=2,tp=2 at ZeRO 1 and
# 3, dp=4,tp=2 at ZeRO 2, fsdp=2 at ZeRO 0; --grad-accum 2 on fsdp=2,tp=2 at ZeRO 1.
@pytest.mark.parametrize("model, mesh, zero, accum", [
    pytest.param(TINY, "fsdp=2,tp=2", 1, 1, id="zero1"),
    pytest.param(TINY, "dp=2,fsdp=2,tp=2", 3, 2, id="accum", marks=pytest.mark.slow),
    pytest.param(MOE, "dp=2,ep=2,tp=2", 0, 1, id="ep", marks=pytest.mark.slow)])
def test_streamed_parameters_match_single_device(corpus, single_device, model, mesh, zero,
                                                 accum):
    """With --grad-accum the micro-batches' gradients accumulate on the device and go to the
    host once (`Plan.grads_stream`)."""
    run = train_steps(model, mesh, corpus.train,
                      config(offload="params", zero=zero, grad_accum=accum))
    assert_matches(run, single_device(model))


# Also equal (by hand): tiny with 6 layers on dp=2,fsdp=2,tp=2 (three chunks of two layers).
@pytest.mark.parametrize("mesh, zero", [
    pytest.param("dp=2,fsdp=2,tp=2", 1, id="dp-fsdp-tp"),
    pytest.param("fsdp=4,tp=2", 3, id="chunks")])
def test_muon_walk_matches_single_device(corpus, single_device, mesh, zero):
    """Muon under --offload params updates on the device a chunk of layers at a time
    (`jdist.step.device_walk`; on fsdp=4,tp=2 two chunks of one layer) and equals one
    device; its state tree is Muon's without offload, so checkpoints move between them."""
    run = train_steps(TINY, mesh, corpus.train,
                      config(optimizer="muon", offload="params", zero=zero))
    assert_matches(run, single_device(TINY, optimizer="muon"))
    trees = [jax.tree.structure(plan_of(mesh, optimizer="muon", offload=offload).abstract)
             for offload in ("params", "none")]
    assert trees[0] == trees[1]


@pytest.mark.slow
def test_streamed_pipeline_matches_single_device(corpus, single_device):
    """pp=2 under --offload params: each stage streams its layers from the host, accumulates
    its gradients over the ticks on the device, and they go to the host once for the host
    update. (Also equal, by hand: Muon on pp=2,tp=2, its update walked on the device.)"""
    run = train_steps(TINY4, "pp=2,fsdp=2", corpus.train, config(offload="params", zero=1),
                      pipeline=PipelineConfig("1f1b", 4, 1))
    assert_matches(run, single_device(TINY4))


# The third mode beside params and disk: AdamW's state in pinned host memory, the update
# unchanged. dp=2,fsdp=2,tp=2 at ZeRO 1 (AdamW and Muon) is in test_zero and test_muon.
@pytest.mark.slow
@pytest.mark.parametrize("model, mesh, zero, pipeline", [
    pytest.param(TINY4, "pp=2,fsdp=2", 2, PipelineConfig("1f1b", 4, 1), id="pp2-zero2"),
    pytest.param(MOE, "dp=2,ep=2,tp=2", 3, None, id="ep-zero3")])
def test_host_optimizer_state_matches_single_device(corpus, single_device, model, mesh, zero,
                                                    pipeline):
    run = train_steps(model, mesh, corpus.train, config(offload="optimizer", zero=zero),
                      pipeline=pipeline)
    assert_matches(run, single_device(model))


def entry_arguments(hlo: str) -> list[str]:
    """The compiled entry computation's parameter layouts, one string each."""
    inputs = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo).group(1)
    return re.findall(r"\w+\[[\d,]*\](?:\{[^}]*\})?", inputs)


def test_streamed_state_lives_in_host_memory():
    """The compiled step takes every parameter and optimizer-state leaf in host memory (the
    batch and the step counter on the device), runs the update as a host computation, and
    the memory model counts none of that state on the device."""
    plan = plan_of("fsdp=2", offload="params", batch_size=8, seq_len=32)
    compiled = lower_step(plan, 8, 32).compile()
    hlo = compiled.as_text()
    args = entry_arguments(hlo)
    on_host = [a for a in args if HOST in a]
    state = len(jax.tree.leaves(plan.abstract.params)) + len(
        jax.tree.leaves(plan.abstract.opt_state))
    assert len(args) == state + 3 and len(on_host) == state, args  # + step, inputs, targets
    assert '_xla_compute_type="host"' in hlo
    predicted = predict(plan, 8, 32)
    assert (predicted.params, predicted.grads, predicted.optimizer) == (0, 0, 0)
    plain = predict(plan_of("fsdp=2", batch_size=8, seq_len=32), 8, 32)
    assert predicted.total < plain.total


def test_accumulated_gradients_are_counted_on_the_device():
    """Under pp or --grad-accum the gradients accumulate on the device and go to the host
    once (`Plan.grads_stream`): the memory model counts what the same layout holds without
    offload; streamed per layer, none."""
    size = dict(batch_size=8, seq_len=32)
    assert predict(plan_of("fsdp=2", offload="params", **size), 8, 32).grads == 0
    for mesh, flags in [("fsdp=2", {"grad_accum": 2}), ("pp=2,fsdp=2", {"n_layers": 4})]:
        grads = [predict(plan_of(mesh, offload=offload, **size, **flags), 4, 32).grads
                 for offload in ("params", "none")]
        assert grads[0] == grads[1] > 0, (mesh, grads)


@pytest.mark.parametrize("flags, what", [
    ({"mesh": "pp=2,fsdp=2", "n_layers": 2}, "pipeline chunks of one layer"),
    ({"on_nan": "skip"}, "--on-nan skip"),
    ({"n_layers": 1}, "a model of one layer")])
def test_what_streaming_cannot_run_is_refused(flags, what):
    with pytest.raises(ConfigError, match=f"--offload params does not run with {re.escape(what)}"):
        plan_for(TrainConfig.of(**{"model": "tiny", "mesh": "fsdp=2", "offload": "params",
                                   **flags}))


def test_refusal_is_one_line_and_exit_2(capsys, tmp_path):
    code = main(["--model", "tiny", "--mesh", "fsdp=2", "--offload", "params", "--on-nan",
                 "skip", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--offload params does not run with" in err[0], err


def test_auto_picks_the_smallest_offload_that_fits(capsys):
    """Between the predictions of no offload and optimizer offload, auto offloads the
    optimizer; below both, the parameters too; with room for all, nothing."""
    flags = dict(model="tiny", mesh="fsdp=2", batch_size=8, seq_len=32)
    need = {}
    for mode in fit.OFFLOADS:
        trial = TrainConfig.of(**flags, offload=mode)
        need[mode] = fit.plan_breakdown(trial, plan_for(trial)[1]).total
    assert need["none"] > need["optimizer"] > need["params"], need
    for budget, chosen in [(need["none"], "none"), (need["none"] - 1, "optimizer"),
                           (need["optimizer"] - 1, "params")]:
        auto = TrainConfig.of(**flags, offload="auto", device_memory_gb=budget / 2**30)
        assert fit.resolve_offload(auto).memory.offload == chosen, (budget, need)
    assert "--offload auto: params" in capsys.readouterr().out


# Muon only: its state holds AdamW's moments too (of every leaf but the matrices), so the
# restores below cover AdamW's host-memory state; AdamW's own case (dur9: 12.8 s) went for
# the suite's time (AdamW resumed onto other meshes: test_checkpoint's elastic tests).
@pytest.mark.slow
def test_resume_onto_another_mesh(tmp_path):
    """Muon (its update walked on the device; one momentum per matrix, AdamW's moments
    elsewhere, in a partitioned optax state; under --schedule wsd) saved under --offload
    params on fsdp=2 at step 2: resumed there, step 3 repeats bitwise; resumed on dp=2,tp=2
    without offload, within 1e-5 (another mesh sums in another order); refused to
    --optimizer adamw. The saved state restores onto either layout bitwise, and under
    --offload optimizer on a third."""
    common = dict(model="tiny", batch_size=8, seq_len=32, warmup=2, eval_every=0,
                  log_every=100, steps=3, optimizer="muon", schedule="wsd")
    losses = lambda history: {r["step"]: r["loss"] for r in history if r["step"] > 2}
    first = losses(train(TrainConfig.of(**common, mesh="fsdp=2", offload="params",
                                        checkpoint_every=2, run_dir=str(tmp_path / "a"))))
    start = str(tmp_path / "a" / "checkpoints" / "2")
    same = losses(train(TrainConfig.of(**common, mesh="fsdp=2", offload="params",
                                       resume=start, run_dir=str(tmp_path / "b"))))
    assert same == first
    with pytest.raises(ConfigError, match="--optimizer muon"):  # AdamW's state is not Muon's
        train(TrainConfig.of(**{**common, "optimizer": "adamw", "schedule": "cosine"},
                             mesh="fsdp=2", resume=start, run_dir=str(tmp_path / "d")))
    other = losses(train(TrainConfig.of(**common, mesh="dp=2,tp=2",
                                        resume=str(tmp_path / "a" / "checkpoints" / "2"),
                                        run_dir=str(tmp_path / "c"))))
    assert sorted(other) == [3]
    np.testing.assert_allclose(other[3], first[3], rtol=1e-5)
    # The saved state itself lands on the other mesh bitwise, and in host memory again
    # under --offload params.
    restored = {}
    for mesh, offload in [("dp=2,tp=2", "none"), ("fsdp=2", "params"),
                          ("dp=2,fsdp=2", "optimizer")]:
        plan = plan_for(TrainConfig.of(**common, mesh=mesh, offload=offload))[1]
        restored[offload], _ = ckpt.restore(tmp_path / "a" / "checkpoints" / "2",
                                            plan.abstract, plan.shardings)
    assert {a.sharding.memory_kind for a in jax.tree.leaves(restored["params"]["params"])} \
        == {"pinned_host"}
    # ... and under --offload optimizer, its optimizer state in host memory on a third mesh.
    state = [k for k in restored["optimizer"] if k != "params" and jax.tree.leaves(
        restored["optimizer"][k])]
    assert {a.sharding.memory_kind for k in state
            for a in jax.tree.leaves(restored["optimizer"][k]) if a.ndim} == {"pinned_host"}
    for other in ("params", "optimizer"):
        for a, b in zip(*(jax.tree.leaves(restored[k]) for k in ("none", other))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
