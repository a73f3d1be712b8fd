"""Multi-head latent attention (DeepSeek-V2/V3; `ModelConfig.kv_lora_rank` > 0).

Keys and values come up, head by head, from one small latent per token (kv_lora_rank,
RMS-normed); queries from their own latent (q_lora_rank) or straight from the residual
stream. Each q/k head is a no-rope part and a rope part (`rope_head_dim`); the key's rope
part is one vector per token shared by every head, so a decoding cache holds just the
latent and that rope key per token (`cached_attention`), not keys and values per head.

The attention itself is the step's kernel, as for every block (`ModelContext.attention`):
values are zero-padded from v_head_dim to the q/k head width and the padding sliced off
after, since the kernels (dense, flash, cuDNN, ring, Ulysses) take one head width for q, k
and v; the scale they apply, head_dim ** -0.5, is MLA's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jdist.models import remat, yarn
from jdist.models.config import ModelConfig
from jdist.models.layers import RMSNorm, apply_rotary, dot_product_attention, param, weight
from jdist.models.projection import project
from jdist.spmd.axes import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    KV_LENGTH,
    LAYERS,
    LENGTH,
)

Q_NAMES, KV_NAMES = (BATCH, LENGTH, HEADS, HEAD_DIM), (BATCH, LENGTH, KV_HEADS, HEAD_DIM)
LATENT_NAMES = (BATCH, LENGTH, None)  # one latent per token, every device whole
# The decoding cache's latents (or rope keys) of every layer: [layers, batch, max_len, 1,
# rank (or rope)]; shared by all heads, so never split over tensor.
LATENT_CACHE = (LAYERS, BATCH, KV_LENGTH, None, None)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, hd, r, rope = (cfg.d_model, cfg.n_heads, cfg.dim_per_head, cfg.kv_lora_rank,
                             cfg.rope_dim)
        self.rank, self.rope, self.value_dim = r, rope, cfg.value_dim
        # YaRN's larger softmax scale, on the queries: the kernels apply head_dim ** -0.5.
        self.q_scale = yarn.softmax_scale(cfg.rope_scaling)
        if cfg.q_lora_rank:
            self.wq_a = param(rngs, (d, cfg.q_lora_rank), (EMBED, None))
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = param(rngs, (cfg.q_lora_rank, h, hd), (None, HEADS, HEAD_DIM))
        else:
            self.wq = param(rngs, (d, h, hd), (EMBED, HEADS, HEAD_DIM))
        self.wkv_a = param(rngs, (d, r + rope), (EMBED, None))  # latent, then the rope key
        self.kv_norm = RMSNorm(r, cfg.norm_eps)
        # Each head's no-rope key, then its value (one weight, as DeepSeek's kv_b_proj).
        self.wkv_b = param(rngs, (r, h, hd - rope + cfg.value_dim), (None, KV_HEADS, HEAD_DIM))
        self.wo = param(rngs, (h, cfg.value_dim, d), (HEADS, HEAD_DIM, EMBED),
                        std=0.02 / (2 * cfg.n_layers) ** 0.5)

    def queries(self, x, cos, sin, ctx) -> jax.Array:
        """[batch, length, heads, head_dim], the rope part rotated."""
        if hasattr(self, "wq"):
            (q,) = ctx.widen(x, (weight(self.wq, x),), "bse,ehd->bshd", (Q_NAMES,))
        else:
            (a,) = ctx.widen(x, (weight(self.wq_a, x),), "bse,er->bsr", (LATENT_NAMES,))
            a = self.q_norm(ctx.constrain(a, LATENT_NAMES))
            q = project("bsr,rhd->bshd", a, weight(self.wq_b, a))
        q = ctx.constrain(checkpoint_name(q, remat.QUERY), Q_NAMES)
        q = rotate_tail(q, cos, sin, self.rope)
        return q if self.q_scale == 1 else q * jnp.asarray(self.q_scale, q.dtype)

    def latent(self, x, cos, sin, ctx) -> tuple[jax.Array, jax.Array]:
        """(normed latent [batch, length, rank], rotated rope key [batch, length, 1, rope])."""
        (ckv,) = ctx.widen(x, (weight(self.wkv_a, x),), "bse,er->bsr", (LATENT_NAMES,))
        ckv = ctx.constrain(ckv, LATENT_NAMES)
        rope_key = apply_rotary(ckv[..., self.rank:][:, :, None, :], cos, sin)
        return self.kv_norm(ckv[..., :self.rank]), rope_key

    def keys_values(self, latent, rope_key, ctx) -> tuple[jax.Array, jax.Array]:
        """Per-head keys [b, t, heads, head_dim] and values [b, t, heads, head_dim] (zero
        past v_head_dim) from the latent and the shared rope key."""
        kv = project("btr,rhd->bthd", latent, weight(self.wkv_b, latent))
        k, v = kv[..., :-self.value_dim], kv[..., -self.value_dim:]
        k = jnp.concatenate([k, jnp.broadcast_to(rope_key, (*k.shape[:3], rope_key.shape[-1]))],
                            axis=-1)
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, k.shape[-1] - v.shape[-1]),))
        return (ctx.constrain(checkpoint_name(k, remat.KEY), KV_NAMES),
                ctx.constrain(checkpoint_name(v, remat.VALUE), KV_NAMES))

    def __call__(self, x, cos, sin, ctx, segment_ids=None, cache: tuple | None = None):
        """[batch, length, embed] -> [batch, length, embed]; with `cache`, (output, cache)
        as `cached_attention` returns them."""
        q = self.queries(x, cos, sin, ctx)
        latent, rope_key = self.latent(x, cos, sin, ctx)
        if cache is not None:
            return self.cached_attention(q, latent, rope_key, cache, ctx)
        k, v = self.keys_values(latent, rope_key, ctx)
        attend = ctx.attention or dot_product_attention
        out = attend(q, k, v, True) if segment_ids is None else \
            attend(q, k, v, True, segment_ids=segment_ids)
        return checkpoint_name(self.output(ctx.constrain(out, Q_NAMES), ctx),
                               remat.ATTENTION_OUT)

    def output(self, out, ctx) -> jax.Array:
        """Heads [b, s, heads, head_dim] (values' padding dropped) -> [b, s, embed]."""
        out = out[..., :self.value_dim]
        return ctx.narrow(out, weight(self.wo, out), "bshd,hde->bse", Q_NAMES)

    def cached_attention(self, q, latent, rope_key, cache: tuple, ctx):
        """Decoding over the latent cache: `cache` = (latents [layers, batch, max_len, 1,
        rank], rope keys [layers, batch, max_len, 1, rope], this layer, the first slot
        written, the slots each query sees) (`cache_parts`). This call's latents are
        written, then every slot's keys and values are expanded from the cache."""
        latents, rope_keys, layer, index, visible = cache
        at = (layer, 0, index, 0, 0)
        latents = jax.lax.dynamic_update_slice(
            latents, latent[:, :, None].astype(latents.dtype)[None], at)
        rope_keys = jax.lax.dynamic_update_slice(
            rope_keys, rope_key.astype(rope_keys.dtype)[None], at)
        k, v = self.keys_values(latents[layer][:, :, 0], rope_keys[layer], ctx)
        out = dot_product_attention(q.astype(k.dtype), k, v, False, visible=visible)
        return self.output(ctx.constrain(out, Q_NAMES), ctx), (latents, rope_keys)


def rotate_tail(x, cos, sin, rope: int) -> jax.Array:
    """Rotary embeddings on the last `rope` dims of x [b, s, heads, dim]; the rest as is."""
    return jnp.concatenate([x[..., :-rope], apply_rotary(x[..., -rope:], cos, sin)], axis=-1)


def cache_parts(cfg: ModelConfig, batch: int, max_len: int) -> tuple[tuple, tuple]:
    """The shapes of MLA's decoding cache: latents and rope keys of every layer."""
    rows = (cfg.n_layers, batch, max_len, 1)
    return (*rows, cfg.kv_lora_rank), (*rows, cfg.rope_dim)
