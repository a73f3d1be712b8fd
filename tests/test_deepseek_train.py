"""A DeepSeek-V3-style tiny model (`deepseek-tiny`: a dense block, then MoE; MLA; sigmoid
group-limited routing with biases and a shared expert; multi-token prediction) trained on
layouts that split it differently, against one device (`jdist.tools.equivalence`)."""

import dataclasses

import numpy as np
import pytest

from jdist.models import get_preset
from jdist.parallel.pipeline import PipelineConfig
from jdist.tools.equivalence import assert_matches, config, train_steps

DEEPSEEK = get_preset("deepseek-tiny")
# 30 s for the one-device reference on 2 busy cores, 35 s more for fsdp x tp, 30 s for ep;
# pp=2 with ring cp in its stages (MLA without MTP) 60-100 s with its reference.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mesh", ["fsdp=2,tp=2", "fsdp=2,ep=4"])
def test_matches_single_device(corpus, single_device, mesh):
    run = train_steps(DEEPSEEK, mesh, corpus.train)
    assert {"wq_a", "wkv_a", "wkv_b"} <= set(run.grads["blocks_1"]["attn"])
    assert "proj" in run.grads["mtp"] and np.abs(run.grads["mtp"]["proj"]).max() > 0
    assert_matches(run, single_device(DEEPSEEK))


def test_mtp_weight_moves_the_objective(corpus, single_device):
    """The objective is the cross-entropy plus mtp_weight x the MTP loss: with weight 0 the
    MTP module gets no gradient and the first step's loss drops by 0.3 x the MTP loss."""
    reference = single_device(DEEPSEEK)
    off = single_device(dataclasses.replace(DEEPSEEK, mtp_weight=0.0))
    assert not np.any(off.grads["mtp"]["proj"])
    assert off.losses[0] < reference.losses[0]


def test_cost_model_counts_mla_and_mtp_flops():
    """The cost model's executed FLOPs of a deepseek-tiny step (grouped experts, dp=8) against
    the compiled step's: MLA's projections and padded values, the MTP block and its second
    pass through the head (before they were counted: 1.21x off; now 0.97)."""
    from jdist.config import TrainConfig
    from jdist.memory import compile_step
    from jdist.plan import cost
    from jdist.step.from_flags import plan_for
    from jdist.tools import gpu_report

    batch, seq = 8, 64
    plan = plan_for(TrainConfig.of(model="deepseek-tiny", mesh="dp=8", batch_size=batch,
                                   seq_len=seq, moe_routing="grouped", attention="xla"))[1]
    text = compile_step(plan, batch, seq).as_text()
    measured = gpu_report.report(text, plan.mesh, unknown_trips=0).executed_flops
    tokens = batch * seq / 8
    predicted = cost.executed_flops(plan.model, seq, tokens, "xla", plan.compute.remat, False,
                                    plan.compute.loss, 1, cost.expert_factor(plan.model, tokens, 1))
    assert 0.9 <= measured / predicted <= 1.05, (measured, predicted)


# MLA and DeepSeek routing without the MTP module (which pp and cp refuse).
MLA = dataclasses.replace(DEEPSEEK, mtp_depth=0)


def test_mla_runs_in_ring_pipeline_stages_match_single_device(corpus, single_device):
    """pp=2 over a heterogeneous MLA stack (two dense blocks, then two MoE ones: each run a
    chunk of every stage, interleaved with V = 2), the ring splitting the sequence inside
    each stage: the ring kernel over MLA's keys and zero-padded values (the suite's one MLA
    ring case; cp=2,fsdp=2 alone ran the same kernel and its own reference). Against one
    device accumulating the same 4 micro-batches (the balance loss is per micro-batch)."""
    model = dataclasses.replace(MLA, n_layers=4, first_dense_layers=2)
    run = train_steps(model, "pp=2,sp=2", corpus.train, config(cp_strategy="ring",
                                                               batch_size=16),
                      pipeline=PipelineConfig("interleaved", 4, 2))
    assert_matches(run, single_device(model, batch_size=16, grad_accum=4))
