"""Heterogeneous stacks (`jdist.models.runs`): a model as runs of equal blocks, each its own
scanned stack (dense blocks, then a mixture of experts), against one device on every
layout that splits the blocks differently, and the homogeneous model's tree unchanged."""

import pytest

from jdist.config import TrainConfig
from jdist.models import get_preset
from jdist.models.runs import runs
from jdist.tools.equivalence import assert_matches, train_steps
from jdist.train.loop import train

HETERO = get_preset("dense-moe-tiny")


def test_a_homogeneous_model_is_one_run_under_blocks():
    assert [(r.key, r.n_layers, r.moe) for r in runs(get_preset("moe-tiny"))] == \
        [("blocks", 2, True)]
    assert [(r.key, r.first, r.n_layers, r.moe, r.d_ff) for r in runs(HETERO)] == \
        [("blocks", 0, 2, False, 128), ("blocks_1", 2, 2, True, 64)]


@pytest.mark.slow  # 30 s with the one-device reference, 13 s more for ep
@pytest.mark.parametrize("mesh", ["fsdp=2,tp=2", "fsdp=2,ep=4"])
def test_dense_then_experts_matches_single_device(corpus, single_device, mesh):
    run = train_steps(HETERO, mesh, corpus.train)
    assert set(run.grads) == {"blocks", "blocks_1", "embed", "final_norm", "head"}
    assert "router" in run.grads["blocks_1"]["mlp"] and "router" not in run.grads["blocks"]["mlp"]
    assert_matches(run, single_device(HETERO))


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
