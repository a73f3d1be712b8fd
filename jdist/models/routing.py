"""DeepSeek-V3's group-limited expert choice (`ModelConfig.n_expert_groups`, `topk_groups`).

The experts fall in equal groups (in DeepSeek-V3, one group per node); a token first picks
its `topk_groups` best groups, each scored by the sum of its two best experts' scores, and
then its top-k experts among theirs only, so its assignments reach few nodes. Only which
experts are chosen changes: their weights are still the scores of those experts
(`models.moe.route`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_scores(scores: jax.Array, n_groups: int) -> jax.Array:
    """scores [T, E] -> [T, groups]: the sum of each group's two best scores."""
    t, e = scores.shape
    return jax.lax.top_k(scores.reshape(t, n_groups, e // n_groups), 2)[0].sum(-1)


def within_best_groups(scores: jax.Array, n_groups: int, topk_groups: int) -> jax.Array:
    """scores [T, E] with every expert outside the token's `topk_groups` best groups at
    -inf, so a top-k over them chooses inside those groups only."""
    if n_groups == 1:
        return scores
    t, e = scores.shape
    best = jax.lax.top_k(group_scores(scores, n_groups), topk_groups)[1]  # [T, kept]
    kept = jax.nn.one_hot(best, n_groups, dtype=jnp.bool_).any(1)       # [T, groups]
    grouped = scores.reshape(t, n_groups, e // n_groups)
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, e)
