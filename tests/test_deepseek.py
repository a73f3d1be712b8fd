"""DeepSeek-V3's pieces: MLA (`models.mla`), group-limited sigmoid routing
(`models.routing`), HF in and out (`jdist.hf.deepseek`), against a random
DeepseekV3ForCausalLM made by transformers (tests/fixtures/make_deepseek_fixture.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_roundtrip import assert_round_trip_is_bitwise, loaded, logits_error

from jdist.config import TrainConfig
from jdist.errors import ConfigError
from jdist.generate import forward, generate, init_cache
from jdist.generate.weights import inference_plan
from jdist.hf.config import model_config
from jdist.hf.load import load_params
from jdist.models.config import get_preset
from jdist.models.context import LOCAL
from jdist.models.loss import IGNORE
from jdist.models.moe import route
from jdist.models.mtp import next_targets, next_tokens
from jdist.spmd.mesh import build_mesh
from jdist.step.from_flags import plan_for

DEEPSEEK = Path(__file__).parent / "fixtures" / "hf" / "deepseek-v3"


def test_config_json_becomes_the_model():
    cfg = model_config(DEEPSEEK)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.dim_per_head, cfg.rope_dim,
            cfg.value_dim) == (16, 32, 16, 8, 12)
    assert (cfg.n_experts, cfg.n_expert_groups, cfg.topk_groups, cfg.top_k,
            cfg.routed_scale, cfg.shared_d_ff, cfg.gating) == (8, 4, 2, 2, 2.5, 32, "sigmoid")
    assert (cfg.n_layers, cfg.first_dense_layers, cfg.dense_d_ff) == (3, 1, 96)
    rope = cfg.rope_scaling
    assert (rope.rope_type, rope.factor, rope.original_max_position, rope.mscale_all_dim) == \
        ("yarn", 4.0, 16, 1.0)


def test_logits_equal_transformers():
    plan, params = loaded(DEEPSEEK)
    ref = np.load(DEEPSEEK / "reference.npz")
    assert ref["min_route_gap"] > 1e-4  # no routing choice within float rounding
    rel = logits_error(plan, params, ref)
    assert rel < 1e-5, rel


def test_round_trip_is_bitwise(tmp_path):
    """HF -> jdist -> HF: every tensor's bytes (the rope rows re-interleaved), and the
    config. (The export also loads in transformers 5.24 with the fixture's logits, exactly:
    checked by hand, as the suite runs without torch.)"""
    plan, params = loaded(DEEPSEEK)
    assert_round_trip_is_bitwise(DEEPSEEK, tmp_path / "out", plan, params)


@pytest.mark.parametrize("changes, says", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}},
     "'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mscale": 1.0,
                          "mscale_all_dim": 0.5, "original_max_position_embeddings": 16}},
     "mscale 1.0 != mscale_all_dim 0.5"),
    ({"n_group": 3}, "--n-expert-groups 3 must divide --n-experts 8"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized \\(fp8"),
])
def test_unsupported_configs_are_refused(tmp_path, changes, says):
    d = tmp_path / "hf"
    shutil.copytree(DEEPSEEK, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | changes))
    with pytest.raises(ConfigError, match=says) as e:
        model_config(d)
    assert "\n" not in str(e.value)


def test_group_limited_routing_chooses_inside_the_best_groups():
    """8 experts in 4 groups of 2, 2 groups kept, top-2. Expert 0 has the best score, but
    its group (0, 1) sums to less than (2, 3) and (4, 5), so it is passed over; the weights
    are the chosen sigmoid scores, renormalised, times the routed scale."""
    cfg = get_preset("tiny", n_experts=8, top_k=2, gating="sigmoid", n_expert_groups=4,
                     topk_groups=2, routed_scale=2.5)
    probs = np.array([[0.95, 0.01, 0.68, 0.5, 0.7, 0.4, 0.2, 0.3]], np.float32)
    logits = np.log(probs / (1 - probs))  # router logits whose sigmoid is `probs`
    weights, experts, _, _ = route(jnp.asarray(logits), jnp.eye(8), cfg)
    assert sorted(np.asarray(experts)[0].tolist()) == [2, 4]  # groups 1.18 and 1.1 > 0.96
    order = np.argsort(np.asarray(experts)[0])
    np.testing.assert_allclose(np.asarray(weights)[0][order], 2.5 * np.array([0.68, 0.7]) / 1.38,
                               rtol=1e-6)
    flat = get_preset("tiny", n_experts=8, top_k=2, gating="sigmoid")
    assert sorted(np.asarray(route(jnp.asarray(logits), jnp.eye(8), flat)[1])[0]) == [0, 4]


def test_routing_bias_moves_the_group_choice():
    """The correction bias counts in the groups' scores too (as DeepSeek-V3's noaux_tc)."""
    cfg = get_preset("tiny", n_experts=4, top_k=1, gating="sigmoid", n_expert_groups=2,
                     topk_groups=1)
    probs = jnp.array([[0.6, 0.5, 0.4, 0.45]])
    logits = jnp.log(probs / (1 - probs))
    assert int(route(logits, jnp.eye(4), cfg)[1][0, 0]) == 0
    bias = jnp.array([0.0, 0.0, 0.3, 0.0])  # group (2, 3): 0.7 + 0.45 > 0.6 + 0.5
    assert int(route(logits, jnp.eye(4), cfg, bias)[1][0, 0]) == 2


def test_mtp_targets_are_the_token_after_next_within_a_document():
    targets = jnp.array([[10, 11, 12, 13, 14]])
    assert next_targets(targets).tolist() == [[11, 12, 13, 14, IGNORE]]
    segments = jnp.array([[0, 0, 0, 1, 1]])  # position 2's next token starts document 1
    assert next_targets(targets, segments).tolist() == [[11, 12, IGNORE, 14, IGNORE]]
    assert next_tokens(jnp.array([[1, 2, 3]])).tolist() == [[2, 3, 3]]


@pytest.mark.parametrize("flags, says", [({"mesh": "pp=2"}, "multi-token prediction"),
                                         ({"mesh": "cp=2"}, "multi-token prediction"),
                                         ({"fp8": "tensorwise"}, "--fp8 is not supported")])
def test_what_deepseek_tiny_cannot_run_is_refused(flags, says):
    with pytest.raises(ConfigError, match=says) as e:
        plan_for(TrainConfig.of(**{"model": "deepseek-tiny", "batch_size": 16, **flags}))
    assert "\n" not in str(e.value)


@pytest.mark.slow  # 7 s on 2 busy cores
def test_latent_cache_decoding_equals_the_full_forward():
    """A prefill of 8 tokens, then 8 decoded one by one over the cache of latents and rope
    keys: the logits of the full forward over all 16 (rel 1e-5)."""
    plan, params = loaded(DEEPSEEK)
    ref = np.load(DEEPSEEK / "reference.npz")
    tokens = ref["input_ids"][:, :16]
    with jax.default_matmul_precision("highest"):
        model = nnx.merge(plan.graphdef, jax.tree.map(np.asarray, params))
        full = np.asarray(jax.jit(lambda tokens: model(tokens))(tokens))
        cache = init_cache(plan.model, np.zeros(2, np.int32), 16, jnp.float32,
                           build_mesh("", jax.devices()[:1]))
        assert cache.keys.shape == (3, 2, 16, 1, 16) and cache.values.shape == (3, 2, 16, 1, 8)
        step = jax.jit(lambda tokens, cache: forward(model, tokens, cache, LOCAL))
        logits, cache = step(tokens[:, :8], cache)
        pieces = [np.asarray(logits)]
        for i in range(8, 16):
            logits, cache = step(tokens[:, i:i + 1], cache)
            pieces.append(np.asarray(logits))
    cached = np.concatenate(pieces, axis=1)
    assert np.linalg.norm(cached - full) / np.linalg.norm(full) < 1e-5


@pytest.mark.parametrize("mesh, n", [("", 1), ("tp=2", 2), ("ep=2", 2)])
def test_greedy_matches_transformers(mesh, n):
    """transformers' generate(max_new_tokens=32, do_sample=False), token for token."""
    ref = np.load(DEEPSEEK / "reference.npz")
    cfg = model_config(DEEPSEEK)
    params = load_params(DEEPSEEK, inference_plan(cfg, build_mesh(mesh, jax.devices()[:n])))
    with jax.default_matmul_precision("highest"):
        out = generate(params, cfg, list(ref["prompt_ids"]), ref["greedy_ids"].shape[1])
    np.testing.assert_array_equal(np.stack(out), ref["greedy_ids"])
