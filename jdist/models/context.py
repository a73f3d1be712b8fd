"""What a training step hands the model: the one channel between `jdist` and `models`.

The model names logical axes and calls these hooks; the step decides what they do (shard
an activation, run a context-parallel attention kernel, dispatch tokens to experts over a
mesh, gather a layer's parameters just in time). The defaults are plain single-device
code, so `Llama(cfg, rngs=...)(tokens)` runs anywhere without jdist's parallel machinery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jdist.models.projection import project


def _identity(x, *_):
    return x


def einsums(x, ws, eq, out_names):
    return tuple(project(eq, x, w) for w in ws)


def einsum(h, w, eq, h_names):
    return project(eq, h, w)


def scan_layers(layer, x, layers, rows, run=None):
    return jax.lax.scan(lambda x, state: layer(x, state, rows), x, layers)


@dataclasses.dataclass(frozen=True)
class ModelContext:
    # constrain(x, logical names) -> x pinned to the sharding the names resolve to.
    constrain: Callable = _identity
    # attention(q [b,s,h,d], k [b,t,kv,d], v, causal) -> [b,s,h,d]; None: dense (models.layers).
    attention: Callable | None = None
    # moe(x [b,s,d], weights, cfg) -> (y, balance sums); None: one local group (models.moe).
    moe: Callable | None = None
    # widen(x [b,s,...], ws, eq, out_names) -> tuple(einsum(eq, x, w) for w in ws): the
    # projections out of the residual stream (q/k/v, gate/up), which share x; `out_names`:
    # each output's logical axes. The step may bring x's length chunk by chunk beside them
    # (`jdist.parallel.collective_matmul`).
    widen: Callable = einsums
    # narrow(h, w, eq, h_names) -> einsum(eq, h, w) [b,s,embed]: the projections back into
    # the residual stream (attention output, down), h's logical axes `h_names`; the step may
    # scatter their partial sums likewise.
    narrow: Callable = einsum
    # layer_loop(layer, x, layers, rows, run) -> (x, stats [layers, ...]): runs `layer(x,
    # state, rows) -> (x, stats)` over the stacked `layers` state of the run stored under
    # the key `run` (`models.runs`); `rows` is a dict of per-row inputs (leading dim batch,
    # as x's) the loop may split with x. The step's gathers each
    # layer's parameters (ahead of time) and checkpoints activations; the default is a plain
    # scan.
    layer_loop: Callable = scan_layers
    # embed_lookup(tokens [b, s]) -> rows [b, s, embed] in compute dtype, from a table the
    # step keeps sharded; None: rows of the model's own table.
    embed_lookup: Callable | None = None
    # dtype of matmuls and of the residual stream (parameters arrive in float32).
    compute_dtype: Any = jnp.float32


LOCAL = ModelContext()
