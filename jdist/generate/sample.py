"""Choosing the next token from logits: greedy (temperature 0), or temperature and nucleus
(top-p) sampling with a `jax.random` key; never an id past the tokenizer's vocabulary."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jdist.errors import require


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static settings (part of the compiled step). temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    # Ids from here on are never chosen: the rows of a vocabulary padded past its
    # tokenizer's (to a multiple of 64 or 128), which no text encodes and the tokenizer
    # cannot decode. 0: every id of the model.
    valid_ids: int = 0

    def check(self) -> None:
        require(self.temperature >= 0,
                f"--temperature {self.temperature} must be 0 (greedy) or positive")
        require(0 < self.top_p <= 1, f"--top-p {self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """Logits [batch, vocab] with every token outside the smallest set whose probability
    reaches `top_p` set to -inf (the most likely token always stays)."""
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    kept = jnp.where(before < top_p, ordered, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def without_padding(logits: jax.Array, valid_ids: int) -> jax.Array:
    """Logits [batch, vocab] with every id >= `valid_ids` set to -inf."""
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < valid_ids, logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token ids [batch] int32 from logits [batch, vocab]."""
    logits = logits.astype(jnp.float32)
    if 0 < sampling.valid_ids < logits.shape[-1]:
        logits = without_padding(logits, sampling.valid_ids)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_p < 1:
        logits = nucleus(logits, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


GREEDY = Sampling()
