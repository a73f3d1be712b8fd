"""DeepSeek-V3's multi-token prediction (`ModelConfig.mtp_depth` = 1): one more block
predicts, at each position i, the token after next (i + 2).

Its input is the main model's last hidden state at i (before the final norm) and the
embedding of token i + 1, each RMS-normed, concatenated (embedding first, as the published
checkpoint's `eh_proj`) and projected back to d_model; then one block (the model's own
kind, handed in), its own final norm, and the model's output head. Training adds its
cross-entropy, times `mtp_weight`, to the objective (`models.loss`); inference ignores it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdist.models.config import ModelConfig
from jdist.models.layers import RMSNorm, param, weight
from jdist.models.loss import IGNORE
from jdist.spmd.axes import EMBED


class MultiTokenPrediction(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, block: nnx.Module):
        d = cfg.d_model
        self.embed_norm = RMSNorm(d, cfg.norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.norm_eps)
        self.proj = param(rngs, (2, d, d), (None, EMBED, None))  # [embedding; hidden] -> d
        self.block = block
        self.norm = RMSNorm(d, cfg.norm_eps)  # before the shared output head

    def __call__(self, hidden, next_embedded, cos, sin, ctx, segment_ids=None) -> jax.Array:
        """hidden [b, s, d] (the last block's output) and next_embedded [b, s, d] (token
        i + 1's embedding at i) -> the block's output [b, s, d], before `self.norm`."""
        e, h = self.embed_norm(next_embedded), self.hidden_norm(hidden)
        w = weight(self.proj, h)
        x = jnp.einsum("bse,ef->bsf", e, w[0]) + jnp.einsum("bse,ef->bsf", h, w[1])
        return self.block(x, cos, sin, ctx, segment_ids)[0]


def next_tokens(tokens: jax.Array) -> jax.Array:
    """Token i + 1 at position i [b, s]; the last position repeats its own (its target is
    not counted: `next_targets`)."""
    return jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)


def next_targets(targets: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """The MTP targets [b, s]: position i's is the main target of i + 1 (token i + 2);
    none for the last position, nor where i + 1 starts another packed document."""
    shifted = jnp.concatenate([targets[:, 1:], jnp.full_like(targets[:, :1], IGNORE)], axis=1)
    if segment_ids is None:
        return shifted
    same = jnp.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1],
                            jnp.zeros_like(segment_ids[:, :1], bool)], axis=1)
    return jnp.where(same, shifted, IGNORE)
