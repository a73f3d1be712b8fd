"""Building blocks of the decoder: parameters with logical names, RMSNorm, rotary embeddings,
and the attention core (a plain function, so context-parallel kernels can replace it)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdist.models import yarn
from jdist.models.config import RopeScaling
from jdist.models.precision import accumulator
from jdist.spmd.axes import NORM

INIT_STD = 0.02


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...],
          std: float = INIT_STD) -> nnx.Param:
    """A float32 parameter drawn from N(0, std^2), annotated with logical axis names."""
    assert len(shape) == len(names), (shape, names)
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    # Shardings are applied by jdist from these names; flax must not try to place eagerly.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def zeros(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    """A float32 parameter that starts at zero (a bias), with logical axis names."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        # Gemma's scales by (1 + scale), the stored scale starting at 0 (as HF stores it, so
        # its files round-trip bitwise).
        start = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(start((dim,), jnp.float32), out_sharding=(NORM,),
                               eager_sharding=False)
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(accumulator(x))
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(x32.dtype)
        return (normed * (1 + scale if self.plus_one else scale)).astype(x.dtype)


@functools.lru_cache(maxsize=64)
def rope_inv_freq(head_dim: int, theta: float,
                  scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies [head_dim/2] of rotary embeddings, float64 (read-only), with the
    Llama 3.x scaling (HF rope_type "llama3") when `scaling` is given."""
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None and scaling.rope_type == "yarn":
        inv_freq = yarn.inv_freq(head_dim, theta, scaling)
    elif scaling is not None and scaling.rope_type == "linear":  # Gemma 3's global layers
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None:
        s = scaling
        wavelen = 2 * np.pi / inv_freq
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        inv_freq = np.where(wavelen > s.original_max_position / s.low_freq_factor,
                            inv_freq / s.factor,
                            np.where(wavelen < s.original_max_position / s.high_freq_factor,
                                     inv_freq, blended))
    inv_freq.setflags(write=False)
    return inv_freq


def rotary_tables(positions: jax.Array | np.ndarray, head_dim: int, theta: float,
                  scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 cos/sin tables [length, head_dim/2] for rotary position embeddings of
    `positions` [length] ([batch, length, head_dim/2] for positions [batch, length]).

    Frequencies are computed on the host in float64. Concrete positions (numpy, or a jax
    array outside a trace) get their angles, cos and sin in float64 too, so long positions
    come out the same under jit and eagerly; traced positions use float32 angles.
    """
    if np.ndim(positions) == 2:  # [batch, length], e.g. restarting at each packed document
        # Rows of the table for 0..length-1 (no position exceeds its index): the same values
        # a document gets when it is run on its own.
        cos, sin = rotary_tables(np.arange(positions.shape[1]), head_dim, theta, scaling)
        return jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
    inv_freq = rope_inv_freq(head_dim, float(theta), scaling)
    try:  # numpy or a concrete array; `jax.core.Tracer` is deprecated from jax 0.10
        host = np.asarray(positions, np.float64)
    except jax.errors.TracerArrayConversionError:
        angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
        gain = np.float32(yarn.rope_gain(scaling))
        return jnp.cos(angles) * gain, jnp.sin(angles) * gain
    angles = host[:, None] * inv_freq[None, :]
    gain = yarn.rope_gain(scaling)
    return (jnp.asarray(np.cos(angles) * gain, jnp.float32),
            jnp.asarray(np.sin(angles) * gain, jnp.float32))


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of the last dim of x [batch, length, heads, dim]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    if cos.ndim == 2:  # one table for every row
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def same_segment(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """[b, s, t] booleans: query i and key j lie in the same packed document."""
    return q_segments[:, :, None] == k_segments[:, None, :]


def in_window(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """[s, t] booleans: key position k_pos[j] is one of the `window` positions a sliding
    window ending at query position q_pos[i] holds (HF's `sliding_window`; causal apart)."""
    return q_pos[:, None] - k_pos[None, :] < window


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True,
                          segment_ids: jax.Array | None = None,
                          visible: jax.Array | None = None, *, window: int | None = None,
                          sinks: jax.Array | None = None):
    """Grouped-query attention. q [b, s, heads, d]; k, v [b, t, kv_heads, d] -> [b, s, heads, d].
    `segment_ids` [b, s] (s == t): a query sees only keys of its own document.
    `visible` [b, s, t] booleans: the keys each query may see (decoding over a KV cache).
    `window` (causal): each query sees only its last `window` keys, itself included.
    `sinks` [heads]: a learned logit per head in every softmax denominator, with no value
    (gpt-oss)."""
    b, s, h, d = q.shape
    t, kv = k.shape[1], k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)  # heads h = kv_head * group + g share one kv head
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=accumulator(q, k))
    scores = scores * (d ** -0.5)
    if causal:
        mask = jnp.arange(s)[:, None] >= jnp.arange(t)[None, :]
        if window is not None:
            mask = mask & in_window(jnp.arange(s), jnp.arange(t), window)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    if segment_ids is not None:
        same = same_segment(segment_ids, segment_ids)[:, None, None]
        scores = jnp.where(same, scores, jnp.finfo(jnp.float32).min)
    if visible is not None:
        scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # the sink as one more column of every row, dropped after the softmax
        column = jnp.broadcast_to(sinks.astype(scores.dtype).reshape(kv, h // kv, 1, 1),
                                  (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, column], -1), -1)[..., :-1]
        probs = probs.astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


def weight(p: nnx.Param, like: jax.Array) -> jax.Array:
    """A parameter's value in the dtype of the activation it multiplies (the step may hand
    it over already cast, after gathering it in the compute dtype). A frozen base weight
    may be handed over quantized (QLoRA's NF4, anything with a `dequantize(dtype)`): it is
    dequantized here, where it is used, so one projection at a time exists in full."""
    value = p.get_value()
    if hasattr(value, "dequantize"):
        return value.dequantize(like.dtype)
    return value.astype(like.dtype)
