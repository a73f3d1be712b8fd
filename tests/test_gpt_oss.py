"""gpt-oss's pieces: attention biases and sinks over sliding and full layers in turn, YaRN
rope, experts with router and expert biases and the clamped SwiGLU; HF in and out
(`jdist.hf.gpt_oss`), against a random GptOssForCausalLM made by transformers
(tests/fixtures/make_gpt_oss_fixture.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_roundtrip import assert_round_trip_is_bitwise, loaded, logits_error

from jdist.errors import ConfigError
from jdist.generate import generate
from jdist.generate.weights import inference_plan
from jdist.hf.config import model_config
from jdist.hf.load import load_params
from jdist.models.config import get_preset
from jdist.models.runs import runs
from jdist.spmd.mesh import build_mesh

GPT_OSS = Path(__file__).parent / "fixtures" / "hf" / "gpt-oss"


def test_config_json_becomes_the_model():
    cfg = model_config(GPT_OSS)
    assert (cfg.sliding_window, cfg.full_attention_every, cfg.attention_sinks,
            cfg.attention_bias) == (4, 2, True, True)
    assert (cfg.n_experts, cfg.top_k, cfg.moe_biases, cfg.swiglu_limit,
            cfg.swiglu_alpha) == (4, 2, True, 3.0, 1.702)
    s = cfg.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position, s.truncate) == ("yarn", 4.0, 64,
                                                                             False)
    assert [r.windows for r in runs(cfg)] == [(4, None)]  # one run of (sliding, full) periods


def test_logits_equal_transformers():
    plan, params = loaded(GPT_OSS)
    ref = np.load(GPT_OSS / "reference.npz")
    assert ref["min_route_gap"] > 1e-4  # no routing choice within float rounding
    rel = logits_error(plan, params, ref)
    assert rel < 1e-5, rel


def test_round_trip_is_bitwise(tmp_path):
    """HF -> jdist -> HF: every tensor's bytes (gate and up re-interleaved into gate_up),
    and the config. (The export also loads in transformers 5.24 with the fixture's
    logits: checked by hand, as the suite runs without torch.)"""
    plan, params = loaded(GPT_OSS)
    assert_round_trip_is_bitwise(GPT_OSS, tmp_path / "out", plan, params)


@pytest.mark.parametrize("changes, says", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "'linear'"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4"),
])
def test_unsupported_configs_are_refused(tmp_path, changes, says):
    d = tmp_path / "hf"
    shutil.copytree(GPT_OSS, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | changes))
    with pytest.raises(ConfigError, match=says) as e:
        model_config(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mesh, n", [("", 1), ("tp=2", 2), ("ep=2", 2)])
def test_greedy_matches_transformers(mesh, n):
    """transformers' generate(max_new_tokens=32, do_sample=False), token for token."""
    ref = np.load(GPT_OSS / "reference.npz")
    cfg = model_config(GPT_OSS)
    params = load_params(GPT_OSS, inference_plan(cfg, build_mesh(mesh, jax.devices()[:n])))
    with jax.default_matmul_precision("highest"):
        out = generate(params, cfg, list(ref["prompt_ids"]), ref["greedy_ids"].shape[1])
    np.testing.assert_array_equal(np.stack(out), ref["greedy_ids"])


@pytest.mark.parametrize("name, billions", [("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)])
def test_published_shapes_count_the_published_parameters(name, billions):
    """The model card's totals (biases, sinks and the untied head included)."""
    cfg = get_preset(name)
    assert cfg.shape_only and [r.windows for r in runs(cfg)] == [(128, None)]
    assert cfg.n_params() / 1e9 == pytest.approx(billions, abs=0.005)


def test_planner_and_memory_tool_take_the_published_shape(capsys):
    """gpt-oss-20b on 8 H100s: the planner finds layouts that fit, and the memory tool
    gives its best one's GiB/dev."""
    from jdist.memory.__main__ import main as memory_main
    from jdist.plan.__main__ import plan_main

    assert plan_main(["--model", "gpt-oss-20b", "--devices", "8", "--accelerator",
                      "h100-80gb", "--batch-size", "16", "--seq-len", "4096", "--json",
                      "--top", "1"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert memory_main(row["memory_command"].split()[3:] + ["--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]
    assert predicted == row["memory"] and predicted["total"] < 80 << 30
