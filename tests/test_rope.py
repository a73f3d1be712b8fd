"""Rotary embeddings: Llama 3.x frequency scaling, float64 host tables, and the Llama presets."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.errors import ConfigError
from jdist.models import PRESETS, get_preset
from jdist.models.config import ALIASES, RopeScaling
from jdist.models.layers import rope_inv_freq, rotary_tables


def reference_inv_freq(head_dim, theta, factor=None, low=1.0, high=4.0, orig=8192):
    """The published llama3 rule, one frequency at a time in plain Python floats."""
    out = []
    for i in range(head_dim // 2):
        f = theta ** (-2 * i / head_dim)
        if factor is not None:
            wavelen = 2 * math.pi / f
            if wavelen > orig / low:
                f = f / factor
            elif wavelen >= orig / high:
                smooth = (orig / wavelen - low) / (high - low)
                f = (1 - smooth) * f / factor + smooth * f
        out.append(f)
    return out


def inv_freq_of(cfg):
    return rope_inv_freq(cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)


@pytest.mark.parametrize("name, factor", [("llama3.1-8b", 8.0), ("llama3.2-1b", 32.0)])
def test_llama3_scaled_frequencies_match_the_published_rule(name, factor):
    cfg = get_preset(name)
    assert cfg.rope_scaling == RopeScaling(factor=factor, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position=8192)
    got = inv_freq_of(cfg)
    want = reference_inv_freq(cfg.dim_per_head, 500_000.0, factor)
    assert got.dtype == np.float64 and got.shape == (cfg.dim_per_head // 2,)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(got.astype(np.float32), np.asarray(want, np.float32))

    # The three regimes: wavelength under 8192/4 kept, over 8192/1 divided, between blended.
    plain = reference_inv_freq(cfg.dim_per_head, 500_000.0)
    wavelen = [2 * math.pi / f for f in plain]
    high = [i for i, w in enumerate(wavelen) if w < 2048]
    low = [i for i, w in enumerate(wavelen) if w > 8192]
    mid = [i for i, w in enumerate(wavelen) if 2048 <= w <= 8192]
    assert high and low and mid
    assert got[high[0]] == plain[high[0]] and got[high[-1]] == plain[high[-1]]
    assert got[low[0]] == pytest.approx(plain[low[0]] / factor, rel=1e-15)
    for i in mid:
        assert plain[i] / factor < got[i] < plain[i]


def test_unscaled_frequencies_are_powers_of_theta():
    for cfg in (get_preset("llama3-8b"), get_preset("tiny"), get_preset("llama2-7b")):
        assert cfg.rope_scaling is None
        d = cfg.dim_per_head
        want = [cfg.rope_theta ** (-2 * i / d) for i in range(d // 2)]
        np.testing.assert_allclose(inv_freq_of(cfg), want, rtol=1e-14, atol=0)


def test_long_positions_agree_under_jit_and_with_a_float64_reference():
    cfg = get_preset("llama3.1-8b")
    args = (cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)
    positions = np.arange(0, 131_072, 32)  # 4096 positions up to 128k
    cos, sin = rotary_tables(positions, *args)
    assert cos.shape == sin.shape == (4096, 64) and cos.dtype == jnp.float32

    jit_cos, jit_sin = jax.jit(lambda: rotary_tables(positions, *args))()
    np.testing.assert_array_equal(jit_cos, cos)
    np.testing.assert_array_equal(jit_sin, sin)
    eager_cos, _ = rotary_tables(jnp.asarray(positions), *args)  # concrete jax positions
    np.testing.assert_array_equal(eager_cos, cos)

    angles = positions[:, None] * np.asarray(reference_inv_freq(*args[:2], 8.0))[None, :]
    np.testing.assert_allclose(cos, np.cos(angles), rtol=0, atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(angles), rtol=0, atol=1e-7)

    # Traced positions: float32 angles, whose rounding at 128k is a few 1e-3 radians.
    traced_cos, traced_sin = jax.jit(lambda p: rotary_tables(p, *args))(jnp.asarray(positions))
    np.testing.assert_allclose(traced_cos, np.cos(angles), rtol=0, atol=2e-2)
    np.testing.assert_allclose(traced_sin, np.sin(angles), rtol=0, atol=2e-2)
    short = slice(0, 32)  # positions < 1024: float32 angles are accurate
    np.testing.assert_allclose(traced_cos[short], cos[short], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name, params", [
    ("llama2-7b", 6.74e9), ("llama3-8b", 8.03e9), ("llama3.1-8b", 8.03e9),
    ("llama3.1-70b", 70.6e9), ("llama3.2-1b", 1.24e9), ("llama3.2-3b", 3.21e9),
])
def test_presets_have_the_public_shapes(name, params):
    cfg = get_preset(name)
    assert cfg.shape_only and cfg.norm_eps == 1e-5
    assert cfg.n_params() == pytest.approx(params, rel=5e-3)


# Published totals (model cards): Qwen3 0.6B/8.2B/32.8B, Mixtral 46.7B, Qwen3-MoE 30.5B and
# 235B; Qwen3's RMSNorm epsilon is 1e-6.
@pytest.mark.parametrize("name, params, eps", [
    ("qwen3-0.6b", 0.6e9, 1e-6), ("qwen3-8b", 8.2e9, 1e-6), ("qwen3-32b", 32.8e9, 1e-6),
    ("mixtral-8x7b", 46.7e9, 1e-5), ("qwen3-30b-a3b", 30.5e9, 1e-6),
    ("qwen3-235b-a22b", 235e9, 1e-6),
])
def test_qwen3_and_moe_presets_have_the_public_sizes(name, params, eps):
    cfg = get_preset(name)
    assert cfg.shape_only and cfg.norm_eps == eps and cfg.qk_norm == name.startswith("qwen3")
    assert cfg.n_params() == pytest.approx(params, rel=1e-2)


def test_preset_details_and_aliases():
    one_b, three_b = get_preset("llama3.2-1b"), get_preset("llama3.2-3b")
    assert (one_b.dim_per_head, three_b.dim_per_head) == (64, 128)
    assert one_b.tie_embeddings and three_b.tie_embeddings
    assert not get_preset("llama3.1-70b").tie_embeddings
    assert get_preset("llama3.1-8b") == dataclasses.replace(
        get_preset("llama3-8b"), rope_scaling=RopeScaling(factor=8.0))
    assert ALIASES == {"1b": "llama3.2-1b", "7b": "llama2-7b", "70b": "llama3.1-70b",
                       "8x7b": "mixtral-8x7b"}
    for alias, target in ALIASES.items():
        assert alias not in PRESETS and get_preset(alias) == get_preset(target)
    assert get_preset("1b", n_layers=2).n_layers == 2
    hash(get_preset("llama3.1-70b"))  # configs stay hashable (static jit arguments)
    with pytest.raises(ConfigError, match="unknown model preset 'huge'.*llama3.2-3b.*1b"):
        get_preset("huge")


@pytest.mark.parametrize("scaling, message", [
    (RopeScaling(factor=0.5), "factor=0.5 must be at least 1"),
    (RopeScaling(low_freq_factor=4.0, high_freq_factor=4.0), "must exceed low_freq_factor"),
    (RopeScaling(low_freq_factor=0.0), "low_freq_factor=0.0 must be positive"),
    (RopeScaling(original_max_position=0), "original_max_position=0 must be positive"),
])
def test_bad_rope_scaling_is_a_config_error(scaling, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("llama3.1-8b", rope_scaling=scaling)
