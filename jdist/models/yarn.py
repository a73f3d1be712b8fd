"""YaRN rotary scaling (`RopeScaling` with rope_type "yarn"; DeepSeek-V3's, as HF computes
it): frequencies that turn fewer than `beta_slow` times over the original context are
interpolated (divided by `factor`), those turning more than `beta_fast` times are kept, and
a linear ramp over the dimensions between blends them. The attention's softmax scale grows
by `softmax_scale`'s factor (DeepSeek's mscale_all_dim)."""

from __future__ import annotations

import math

import numpy as np


def correction_dim(rotations: float, dim: int, theta: float, max_position: int) -> float:
    """The dimension whose frequency turns `rotations` times over `max_position`."""
    return dim * math.log(max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def inv_freq(dim: int, theta: float, scaling) -> np.ndarray:
    """Inverse frequencies [dim/2], float64."""
    kept = theta ** -(np.arange(0, dim, 2, dtype=np.float64) / dim)
    low = correction_dim(scaling.beta_fast, dim, theta, scaling.original_max_position)
    high = correction_dim(scaling.beta_slow, dim, theta, scaling.original_max_position)
    if scaling.truncate:  # gpt-oss's configs say false: the ramp's ends stay fractional
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / ((high - low) or 0.001), 0, 1)
    return kept / scaling.factor * ramp + kept * (1 - ramp)


def softmax_scale(scaling) -> float:
    """The factor on the attention scores (1 without YaRN or its mscale_all_dim)."""
    if scaling is None or scaling.rope_type != "yarn" or not scaling.mscale_all_dim \
            or scaling.factor <= 1:
        return 1.0
    return (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2


def rope_gain(scaling) -> float:
    """The factor on cos and sin (HF's attention_factor): 1 without YaRN."""
    return 1.0 if scaling is None or scaling.rope_type != "yarn" else scaling.attention_factor


def default_attention_factor(factor: float) -> float:
    """HF's attention_factor when a yarn config gives neither it nor mscale (gpt-oss)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
