"""The KV cache of decoding: every layer's keys and values of the tokens so far, laid out by
the same logical-axis rules as training (kv heads over `tensor`, the batch over the
replica axes), and what each new token may attend to.

Prompts of different lengths are left-padded to a common length, so every row writes the
same slot at each step (one scalar write index); `start` marks each row's first real slot
and padding is never visible. Positions count from a row's first real token, so a row
computes what its prompt computes alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jdist.errors import require
from jdist.models import ModelConfig
from jdist.models.llama import KV_CACHE
from jdist.models.mla import LATENT_CACHE, cache_parts
from jdist.spmd import axes as ax
from jdist.spmd.rules import DEFAULT_RULES, Rules, batch_split, resolve
from jdist.spmd.sharding import check_divisible


class KVCache(NamedTuple):
    keys: jax.Array    # [layers, batch, max_len, kv_heads, head_dim], compute dtype
    values: jax.Array  # same (MLA: latents and rope keys, `cache_shapes`)
    length: jax.Array  # int32 scalar: slots filled, where the next token is written
    start: jax.Array   # int32 [batch]: each row's first real slot (left padding before it)

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> tuple[tuple, tuple]:
    """The shapes of the cache's two stacks: keys and values; with MLA, the latents and the
    rope keys (`models.mla.cache_parts`)."""
    if cfg.kv_lora_rank:
        return cache_parts(cfg, batch, max_len)
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.dim_per_head)
    return shape, shape


def cache_names(cfg: ModelConfig) -> tuple[str | None, ...]:
    """The logical axes of both stacks: MLA's latents are every head's, never split."""
    return LATENT_CACHE if cfg.kv_lora_rank else KV_CACHE


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype) -> int:
    """Bytes of a KVCache over all devices: keys and values, plus the int32 length and
    starts."""
    kv = sum(int(np.prod(s)) for s in cache_shapes(cfg, batch, max_len))
    return kv * jnp.dtype(dtype).itemsize + 4 + 4 * batch


def cache_shardings(mesh, rules: Rules = DEFAULT_RULES, names=KV_CACHE) -> KVCache:
    """Where each part of the cache lives: keys/values by their logical `names`
    (`cache_names`)."""
    kv = NamedSharding(mesh, resolve(names, rules, mesh))
    return KVCache(kv, kv, NamedSharding(mesh, resolve((), rules, mesh)),
                   NamedSharding(mesh, resolve((ax.BATCH,), rules, mesh)))


def init_cache(cfg: ModelConfig, start: np.ndarray, max_len: int, dtype, mesh,
               rules: Rules = DEFAULT_RULES) -> KVCache:
    """An empty cache for rows whose first real slots are `start` [batch], allocated directly
    in its shardings (no device holds more than its shard)."""
    shapes = cache_shapes(cfg, len(start), max_len)
    batch_axes, ways = batch_split(mesh.shape, rules)
    require(len(start) % ways == 0,
            f"{len(start)} prompts cannot be split over {'x'.join(batch_axes)}={ways} devices; "
            f"give a multiple of {ways} prompts or drop those axes from --mesh")
    for shape in shapes:
        check_divisible(shape, cache_names(cfg), mesh, rules, "KV cache")
    start = np.asarray(start, np.int32)

    def empty() -> KVCache:
        keys, values = (jnp.zeros(shape, dtype) for shape in shapes)
        return KVCache(keys, values, jnp.int32(0), jnp.asarray(start))
    return jax.jit(empty, out_shardings=cache_shardings(mesh, rules, cache_names(cfg)))()


def attention_window(cache: KVCache, length: int) -> tuple[jax.Array, jax.Array]:
    """For `length` tokens written at slots cache.length..: their positions [batch, length]
    in their own text, and the slots each may see [batch, length, max_len] (its row's real
    tokens up to itself)."""
    slots = cache.length + jnp.arange(length, dtype=jnp.int32)
    positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)  # padding: position 0
    keys = jnp.arange(cache.max_len, dtype=jnp.int32)
    visible = (keys[None, None, :] >= cache.start[:, None, None]) & \
        (keys[None, None, :] <= slots[None, :, None])
    return positions, visible
