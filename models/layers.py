"""Building blocks of the decoder: parameters with logical names, RMSNorm, rotary embeddings,
and the attention core (a plain function, so context-parallel kernels can replace it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdist.axes import NORM

INIT_STD = 0.02


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...],
          std: float = INIT_STD) -> nnx.Param:
    """A float32 parameter drawn from N(0, std^2), annotated with logical axis names."""
    assert len(shape) == len(names), (shape, names)
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    # Shardings are applied by jdist from these names; flax must not try to place eagerly.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=(NORM,),
                               eager_sharding=False)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rotary_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, ...]:
    """cos/sin tables [length, head_dim/2] for rotary position embeddings."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of the last dim of x [batch, length, heads, dim]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True):
    """Grouped-query attention. q [b, s, heads, d]; k, v [b, t, kv_heads, d] -> [b, s, heads, d]."""
    b, s, h, d = q.shape
    t, kv = k.shape[1], k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)  # heads h = kv_head * group + g share one kv head
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    if causal:
        mask = jnp.arange(s)[:, None] >= jnp.arange(t)[None, :]
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


def weight(p: nnx.Param, like: jax.Array) -> jax.Array:
    """A parameter's value in the dtype of the activation it multiplies (the step may hand
    it over already cast, after gathering it in the compute dtype)."""
    return p[...].astype(like.dtype)
