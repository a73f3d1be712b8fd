"""Text generation with a KV cache: one jitted prefill over the (left-padded) prompts fills
the cache, then one jitted decode step per token reads and extends it in place (the cache
is donated). Greedy by default; temperature and nucleus sampling otherwise.

    params, cfg -> generate(params, cfg, [ids, ...], max_new_tokens) -> [new ids, ...]

`stream` yields each step's tokens as they are produced (`python -m jdist.generate` prints
them as text). The weights may be sharded by any plan (`jdist.generate.weights`); the
cache follows the same rules (`jdist.generate.cache`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jdist.generate.cache import (
    KVCache,
    attention_window,
    cache_bytes,
    cache_names,
    cache_shardings,
    init_cache,
)
from jdist.generate.sample import GREEDY, Sampling, sample
from jdist.models import Llama, ModelConfig
from jdist.models.context import ModelContext
from jdist.models.names import EMBED
from jdist.parallel import embedding
from jdist.spmd import axes as ax
from jdist.spmd.rules import (
    DEFAULT_RULES,
    Rules,
    batch_split,
    constrainer,
    mesh_axes_of,
    resolve,
)

__all__ = ["KVCache", "Sampling", "cache_bytes", "forward", "generate", "init_cache",
           "left_pad", "stream"]


PAD_MULTIPLE = 16  # prompt batches are padded to a multiple: fewer shapes to compile


def left_pad(prompts: Sequence[np.ndarray],
             multiple: int = PAD_MULTIPLE) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of token ids -> (tokens [batch, length] int32, left-padded with 0 to the
    longest rounded up to `multiple`; the first real slot of each row [batch])."""
    length = -(-max(len(p) for p in prompts) // multiple) * multiple
    tokens = np.zeros((len(prompts), length), np.int32)
    for row, p in zip(tokens, prompts):
        row[length - len(p):] = p
    return tokens, np.array([length - len(p) for p in prompts], np.int32)


def forward(model: Llama, tokens: jax.Array, cache: KVCache,
            ctx: ModelContext) -> tuple[jax.Array, KVCache]:
    """tokens [batch, length] written at the cache's next slots -> (logits [batch, length,
    vocab], the cache extended by `length` slots)."""
    positions, visible = attention_window(cache, tokens.shape[1])
    logits, (keys, values) = model.decode(tokens, (cache.keys, cache.values), cache.length,
                                          positions, visible, ctx)
    return logits, cache._replace(keys=keys, values=values,
                                  length=cache.length + tokens.shape[1])


@functools.lru_cache(maxsize=8)
def graphdef_of(cfg: ModelConfig) -> nnx.GraphDef:
    return nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))


def mesh_of(params: dict):
    """The mesh the parameters are laid out on."""
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    from jdist.spmd.mesh import build_mesh

    return build_mesh("", list(sharding.device_set))


@functools.lru_cache(maxsize=8)
def compiled_step(cfg: ModelConfig, mesh, rules: Rules, dtype, sampling: Sampling) -> Callable:
    """(params, cache, tokens [batch, length], key, step) -> (next tokens [batch, 1], cache):
    the prefill (length = the prompt) and the decode step (length 1) are its two shapes."""
    ctx = ModelContext(constrain=constrainer(mesh, rules), compute_dtype=dtype)
    graphdef = graphdef_of(cfg)
    # Rows are looked up where the table lies over the vocabulary's axes, never gathering
    # the whole table (jdist.parallel.embedding, as the training step does).
    vocab_axes = mesh_axes_of(resolve((ax.VOCAB, ax.EMBED), rules, mesh)[0])

    def step(params, cache, tokens, key, i):
        table = embedding.Table(mesh, params[EMBED].shape, vocab_axes)
        lookup = lambda t: table.take(params[EMBED], t).astype(dtype)
        model = nnx.merge(graphdef, params)
        logits, cache = forward(model, tokens, cache,
                                dataclasses.replace(ctx, embed_lookup=lookup))
        return sample(logits[:, -1], jax.random.fold_in(key, i), sampling)[:, None], cache

    tokens_sh = NamedSharding(mesh, resolve((ax.BATCH, ax.LENGTH), rules, mesh))
    cache_sh = cache_shardings(mesh, rules, cache_names(cfg))
    return jax.jit(step, donate_argnums=1, out_shardings=(tokens_sh, cache_sh))


def stream(params: dict, cfg: ModelConfig, prompts: Sequence[np.ndarray],
           max_new_tokens: int, *, sampling: Sampling = GREEDY, seed: int = 0,
           dtype=jnp.float32, rules: Rules = DEFAULT_RULES) -> Iterator[np.ndarray]:
    """Yields the next token of every prompt [batch] int32, `max_new_tokens` times (stop
    early by closing the generator). `params` (a pure dict, like TrainState.params) may be
    sharded on any mesh, as `rules` lay them out; the cache is laid out on the same one.
    Each step is dispatched before the previous step's tokens are read, so the host never
    stalls the device."""
    mesh = mesh_of(params)
    # Rows split over the batch's mesh axes: a batch that does not divide is filled up
    # with copies of its last prompt, whose tokens are dropped.
    n, ways = len(prompts), batch_split(mesh.shape, rules)[1]
    tokens, start = left_pad(list(prompts) + [prompts[-1]] * (-n % ways))
    cache = init_cache(cfg, start, tokens.shape[1] + max_new_tokens, dtype, mesh, rules)
    step = compiled_step(cfg, mesh, rules, jnp.dtype(dtype), sampling)
    key = jax.random.key(seed)
    tokens = jax.device_put(tokens, NamedSharding(mesh, resolve((ax.BATCH, ax.LENGTH),
                                                                rules, mesh)))
    tokens, cache = step(params, cache, tokens, key, np.int32(0))
    for i in range(1, max_new_tokens + 1):
        current = tokens
        if i < max_new_tokens:
            tokens, cache = step(params, cache, current, key, np.int32(i))
        yield np.asarray(current)[:n, 0]


def generate(params: dict, cfg: ModelConfig, prompts: Sequence[np.ndarray],
             max_new_tokens: int, *, eod_id: int | None = None, **options) -> list[np.ndarray]:
    """The new tokens of every prompt: `max_new_tokens`, or fewer up to and including
    `eod_id`. Options as `stream`'s."""
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for tokens in stream(params, cfg, prompts, max_new_tokens, **options):
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                out[row].append(token)
                done[row] = token == eod_id
        if all(done):
            break
    return [np.array(ids, np.int32) for ids in out]
