"""gpt-oss's blocks (the fixture's config, tests/test_gpt_oss.py: (sliding, full) layers as
one run of periods, sinks, q/k/v/o biases, YaRN, experts with router and expert biases)
trained on layouts that split them differently, against one device
(`jdist.tools.equivalence`). From the harness's own initialisation (N(0, 0.02): the
fixture's N(0, 0.3) weights amplify float32 rounding to ~1e-4 in the first layers'
gradients, on one device as on tp=2), with the SwiGLU's limit at 0.1 so that the clamp
bites at that scale; the biases start at zero and move after the first step."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from jdist.hf.config import model_config
from jdist.parallel.pipeline import PipelineConfig
from jdist.tools.equivalence import assert_matches, config, train_steps

GPT_OSS = Path(__file__).parent / "fixtures" / "hf" / "gpt-oss"
MODEL = dataclasses.replace(model_config(GPT_OSS), swiglu_limit=0.1)
pytestmark = pytest.mark.slow  # each layout with its one-device reference: 20-40 s


@pytest.mark.parametrize("mesh", ["fsdp=2,tp=2", "fsdp=2,ep=4"])
def test_matches_single_device(corpus, single_device, mesh):
    run = train_steps(MODEL, mesh, corpus.train)
    for kind in ("layer_0", "layer_1"):  # the biases learn in both blocks of the period
        block = run.grads["blocks"][kind]
        for grad in (block["attn"]["bq"], block["attn"]["bo"], block["attn"]["sinks"],
                     block["mlp"]["router_b"], block["mlp"]["b_gate"], block["mlp"]["b_down"]):
            assert np.abs(grad).max() > 0
    assert_matches(run, single_device(MODEL))


def test_ring_inside_pipeline_stages_matches_single_device(corpus, single_device):
    """pp=2 with two (sliding, full) periods, one per stage, and the ring splitting the
    sequence inside each: windows, sinks, biases and experts together. Against one device
    accumulating the same 4 micro-batches (the balance loss is per micro-batch)."""
    model = dataclasses.replace(MODEL, n_layers=4)
    run = train_steps(model, "pp=2,sp=2", corpus.train, config(cp_strategy="ring",
                                                               batch_size=16),
                      pipeline=PipelineConfig("1f1b", 4, 1))
    assert_matches(run, single_device(model, batch_size=16, grad_accum=4))
