"""Heterogeneous stacks (`jdist.models.runs`): a model as runs of equal blocks, each its own
scanned stack (dense blocks, then a mixture of experts), against one device on every
layout that splits the blocks differently, and the homogeneous model's tree unchanged."""

import dataclasses
import json

import pytest

from jdist.config import TrainConfig
from jdist.memory import measure, predict
from jdist.models import get_preset
from jdist.models.runs import runs
from jdist.parallel.pipeline import PipelineConfig
from jdist.plan.__main__ import main as plan_main
from jdist.tools.equivalence import assert_matches, config, plan_of, train_steps
from jdist.train.loop import train

HETERO = get_preset("dense-moe-tiny")


def test_a_homogeneous_model_is_one_run_under_blocks():
    assert [(r.key, r.n_layers, r.moe) for r in runs(get_preset("moe-tiny"))] == \
        [("blocks", 2, True)]
    assert [(r.key, r.first, r.n_layers, r.moe, r.d_ff) for r in runs(HETERO)] == \
        [("blocks", 0, 2, False, 128), ("blocks_1", 2, 2, True, 64)]


@pytest.mark.slow  # 2 x 4 steps on two meshes
def test_resume_onto_another_mesh(tmp_path):
    """Both runs' stacks (and the experts' routing biases, moved by the rows of the loads
    that are theirs) live in the checkpoint: resumed on another mesh, the steps after go on
    exactly as the uninterrupted run's."""
    run = {"model": "dense-moe-tiny", "router_bias_rate": 0.05, "batch_size": 8,
           "seq_len": 32, "steps": 4, "warmup": 2, "eval_every": 0, "checkpoint_every": 2}
    full = train(TrainConfig.of(**run, mesh="fsdp=2,ep=4", run_dir=str(tmp_path / "a")))
    resumed = train(TrainConfig.of(**run, mesh="dp=2,tp=2", run_dir=str(tmp_path / "b"),
                                   resume=str(tmp_path / "a" / "checkpoints" / "2")))
    full = {r["step"]: r["loss"] for r in full}
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        assert r["loss"] == pytest.approx(full[r["step"]], rel=1e-5)


@pytest.mark.slow  # a compile and a planner search: 16 s of CPU
def test_memory_model_and_planner_take_the_runs(capsys, monkeypatch, tmp_path):
    """The memory model counts both runs' stacks (the state within test_memory's 5% of the
    CPU-compiled step) and a periodic run's rows (its activations within 5%), and the
    planner plans the model: expert layouts among its rows."""
    plan = plan_of("fsdp=2,ep=2,tp=2", model="dense-moe-tiny", zero=2, batch_size=16,
                   seq_len=32)
    predicted, measured = predict(plan, 16, 32), measure(plan, 16, 32)
    for key in ("params", "grads", "optimizer"):
        a, b = getattr(predicted, key), getattr(measured, key)
        assert abs(a - b) <= 0.05 * b, (key, a, b)
    # A row of (sliding, full) blocks is one checkpoint: under `full` its input is kept and
    # its backward holds both blocks' residuals (47% under the compiled bytes when a row
    # was counted as a block).
    periods = plan_of("fsdp=2,tp=2", model="tiny", n_layers=8, d_ff=128, sliding_window=8,
                      full_attention_every=2, zero=2, batch_size=16, seq_len=64, remat="full")
    predicted, measured = predict(periods, 16, 64), measure(periods, 16, 64)
    for key in ("activations", "total"):
        ratio = getattr(measured, key) / getattr(predicted, key)
        assert abs(ratio - 1) <= 0.05, (key, ratio)  # test_memory's ACTIVATIONS_RTOL
    monkeypatch.setenv("JDIST_CALIBRATION", str(tmp_path / "none.toml"))
    assert plan_main(["--model", "dense-moe-tiny", "--devices", "8", "--accelerator",
                      "cpu-sim", "--batch-size", "16", "--seq-len", "32", "--fix",
                      "ep=2,tp=2,pp=1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and all("ep=2" in r["layout"] for r in rows)


@pytest.mark.slow  # the reference accumulates 4 micro-batches: two compiles
def test_pipeline_stages_hold_a_share_of_each_run(corpus, single_device):
    """pp=2 over dense blocks then experts: each run is a chunk of every stage (interleaved,
    V = 2 runs), so stage 0 runs dense then, in the second chunk, experts. Against one
    device accumulating the same strided micro-batches (balance losses are per
    micro-batch). The suite's dense-then-experts equivalence case of these blocks (fsdp=2,ep=4
    and fsdp=2,tp=2: test_deepseek_train's, whose model is dense then experts too)."""
    run = train_steps(HETERO, "pp=2,dp=2,ep=2", corpus.train, config(batch_size=16),
                      pipeline=PipelineConfig("interleaved", 4, 2))
    assert set(run.grads) == {"blocks", "blocks_1", "embed", "final_norm", "head"}
    assert "router" in run.grads["blocks_1"]["mlp"] and "router" not in run.grads["blocks"]["mlp"]
    assert_matches(run, single_device(HETERO, batch_size=16, grad_accum=4))


@pytest.mark.parametrize("args, message", [
    (["--model", "dense-moe-tiny", "--mesh", "pp=2"],
     "use --pp-schedule interleaved --pp-virtual-stages 2"),
    (["--model", "moe-tiny", "--first-dense-layers", "2"],
     "--first-dense-layers 2 must leave at least one of the 2 layers to the experts"),
])
def test_bad_runs_are_one_line(train_refusal, args, message):
    assert message in train_refusal(["--steps", "1", *args])


def test_a_repeating_attention_pattern_is_one_run_of_periods():
    """gpt-oss (sliding and full in turn) and Gemma 3 (five local, one global; 62 layers:
    ten periods, then two local layers) as runs; with DeepSeek's dense first block, the
    pattern continues across the two kinds."""
    gpt_oss = dataclasses.replace(HETERO, first_dense_layers=0, n_layers=24,
                                  sliding_window=128, full_attention_every=2)
    assert [(r.first, r.n_layers, r.rows, r.windows) for r in runs(gpt_oss)] == \
        [(0, 24, 12, (128, None))]
    gemma = dataclasses.replace(get_preset("tiny"), n_layers=62, sliding_window=1024,
                                full_attention_every=6)
    assert [(r.first, r.rows, r.windows) for r in runs(gemma)] == \
        [(0, 10, (1024,) * 5 + (None,)), (60, 2, (1024,))]
    # Llama 4's NoPE layers (every 4th without rotary embeddings), with a window pattern:
    # one period of lcm(2, 4) blocks.
    nope = dataclasses.replace(get_preset("tiny"), n_layers=8, sliding_window=8,
                               full_attention_every=2, nope_every=4)
    assert [(r.rows, r.kinds) for r in runs(nope)] == \
        [(2, ((8, True), (None, True), (8, True), (None, False)))]
    mixed = dataclasses.replace(HETERO, n_layers=6, first_dense_layers=1, sliding_window=8,
                                full_attention_every=2)
    assert [(r.key, r.first, r.n_layers, r.moe, r.windows) for r in runs(mixed)] == [
        ("blocks", 0, 1, False, (8,)), ("blocks_1", 1, 1, True, (None,)),
        ("blocks_2", 2, 4, True, (8, None))]


PATTERN = dataclasses.replace(get_preset("tiny"), n_layers=4, sliding_window=8,
                              full_attention_every=2, nope_every=2)


@pytest.mark.slow  # 2 compiles
def test_sliding_and_full_layers_in_turn_match_single_device(corpus, single_device):
    """One run whose rows are (sliding with rotary embeddings, full without) periods; the
    window reaches the kernel of each block (the flash kernel here, xla on one device)."""
    run = train_steps(PATTERN, "fsdp=2,tp=2", corpus.train, config(attention="flash"))
    assert set(run.grads["blocks"]) == {"layer_0", "layer_1"}
    assert_matches(run, single_device(PATTERN))
