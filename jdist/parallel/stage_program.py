"""What one (stage, replica) runs inside the pipeline's `shard_map`: every tick of the
schedule table (`jdist.parallel.schedule`), one operation per tick, then the two permutes.

A tick is nothing, a forward, or a backward of one micro-batch on one chunk of layers.
The chunk itself is the caller's `chunk_fn(v, block, shared, x, m, first, last) -> (y,
loss terms)`: it embeds on the first chunk and adds the loss on the last; this program only
schedules. A forward reads the chunk input from the stash. A backward pulls the
micro-batch's cotangent back through the chunk, accumulating block and shared gradients (in
whatever layout the caller differentiates: jdist.parallel.grad_sync), from one of two
sources. With `stash_residuals` (any `--remat` but full) the forward kept what the backward
reads, as the layer's remat policy decides (`jdist.parallel.residuals`): the same FLOPs as
an unpipelined step, residuals of the in-flight micro-batches held. Without, the backward
recomputes the chunk from its stashed input (`jax.vjp`): only chunk inputs are held, and
every chunk's forward runs twice.
After the `lax.switch`, `ppermute`s pass the forward output to the next stage and the input
cotangent to the previous one; the table says which slot receives them. Permutes stay
outside the switch: see `jdist.parallel.ring_attention.Ring.shift` for what a permute
inside one stage's branch does on XLA.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdist import axes as ax
from jdist.parallel import residuals
from jdist.parallel import schedule as sched


def program(blocks, shared, *, table: sched.Schedule, chunk_fn: Callable, act_shape: tuple,
            act_dtype, n_terms: int, train: bool, stash_residuals: bool = False):
    """One (stage, replica)'s share of the step: run every tick of `table`. `blocks` holds
    this stage's chunks stacked [virtual * layers per chunk, ...] (what is differentiated).
    `stash_residuals` needs a `table` built with `stash`. Returns (loss terms summed over
    micro-batches / M, and when training (block grads, shared grads) of this stage; shared
    grads are nonzero only where a chunk used them)."""
    stages, virtual, micro = table.stages, table.virtual, table.micro
    last_chunk = stages * virtual - 1
    stage = jax.lax.axis_index(ax.STAGE)
    chunks = jax.tree.map(lambda b: b.reshape(virtual, -1, *b.shape[1:]), blocks)
    act = jnp.zeros(act_shape, act_dtype)
    no_loss = jnp.zeros(n_terms, jnp.float32)
    cyclic = virtual > 1  # the last stage's chunk v feeds the first stage's chunk v+1
    to_next = [(i, (i + 1) % stages) for i in range(stages if cyclic else stages - 1)]
    to_prev = [(j, i) for i, j in to_next]

    params_def = jax.tree.structure((blocks, shared))
    chunk_params = lambda v: jax.tree.leaves((jax.tree.map(lambda b: b[v], chunks), shared))

    def f(where, p, x, m):  # the chunk on flat arrays (jdist.parallel.residuals)
        v, first, last = where
        return chunk_fn(v, *jax.tree.unflatten(params_def, p), x, m, first, last)

    def where_of(v):  # the chunk a tick runs, and whether it is the first or the last
        c = v * stages + stage
        return [v, c == 0, c == last_chunk]

    # Traced once for all ticks: chunks differ only in the (traced) chunk index.
    zero = jnp.zeros((), jnp.int32)
    split = residuals.split(f, where_of(zero), chunk_params(zero), act, zero) \
        if stash_residuals and train else None
    no_res = [jnp.zeros(a.shape, a.dtype) for a in split.stash_avals()] if split else []

    def tick(carry, row):
        stash, grads_in, res_stash, acc, loss_sum = carry
        kind, m, v, in_slot, grad_slot, recv_fwd, recv_bwd, res_slot = (
            row[i][stage] for i in range(8))
        where, p = where_of(v), chunk_params(v)
        last = where[2]
        x_in = stash[jnp.maximum(in_slot, 0)]

        def idle():
            return act, act, acc, no_loss, no_res

        def forward():
            if split:
                y, loss, res = split.forward([*where, *p], x_in, m)
                return y, act, acc, loss, res
            y, loss = f(where, p, x_in, m)
            return y, act, acc, loss, no_res

        def backward():  # pull back this micro-batch's cotangent
            if split:
                pullback = split.pullback([*where, *p],
                                          [b[jnp.maximum(res_slot, 0)] for b in res_stash])
            else:  # recompute the chunk from its input
                _, pullback = jax.vjp(lambda p, x: f(where, p, x, m), p, x_in)
            cot_y = jnp.where(last, act, grads_in[jnp.maximum(grad_slot, 0)])
            # The objective (term 0) of each micro-batch weighs 1/M in the step's mean.
            d_p, d_x = pullback((cot_y, no_loss.at[0].set(1.0 / micro)))
            d_block, d_shared = jax.tree.unflatten(params_def, d_p)
            d_chunks = jax.tree.map(lambda a, g: a.at[v].add(g), acc[0], d_block)
            return (act, d_x, (d_chunks, jax.tree.map(jnp.add, acc[1], d_shared)), no_loss,
                    no_res)

        ops = (idle, forward, backward) if train else (idle, forward)
        y, d_x, acc, loss, res = jax.lax.switch(kind, ops)
        stash = _store(stash, recv_fwd, jax.lax.ppermute(y, ax.STAGE, to_next))
        if train:
            grads_in = _store(grads_in, recv_bwd, jax.lax.ppermute(d_x, ax.STAGE, to_prev))
        written = jnp.where(kind == sched.FWD, res_slot, -1)
        res_stash = [_store(b, written, r) for b, r in zip(res_stash, res)]
        return (stash, grads_in, res_stash, acc, loss_sum + loss), None

    f32_zeros = lambda t: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), t)
    res_stash = [jnp.zeros((table.n_res_slots, *r.shape), r.dtype) for r in no_res]
    start = (jnp.zeros((table.n_slots, *act_shape), act_dtype),
             jnp.zeros((table.n_grad_slots, *act_shape), act_dtype) if train else (),
             res_stash, (f32_zeros(chunks), f32_zeros(shared)) if train else (), no_loss)
    (_, _, _, acc, loss_sum), _ = jax.lax.scan(tick, start, jnp.asarray(_columns(table)))
    if not train:
        return loss_sum / micro
    d_chunks, d_shared = acc
    d_blocks = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), d_chunks)
    return loss_sum / micro, (d_blocks, d_shared)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """buffer[slot] = value, or unchanged when slot < 0 (nothing arrived)."""
    i = jnp.maximum(slot, 0)
    return jax.lax.dynamic_update_index_in_dim(
        buffer, jnp.where(slot >= 0, value, buffer[i]), i, 0)


def _columns(table: sched.Schedule) -> np.ndarray:
    """The schedule as int32 [ticks, 8, stages]: kind, micro-batch, chunk and the slots."""
    kind = [[op.kind if op else sched.IDLE for op in row] for row in table.grid]
    micro = [[op.micro if op else 0 for op in row] for row in table.grid]
    chunk = [[op.chunk if op else 0 for op in row] for row in table.grid]
    res_slot = table.res_slot or [[-1] * table.stages for _ in table.grid]
    return np.stack([np.array(x, np.int32) for x in (
        kind, micro, chunk, table.in_slot, table.grad_slot, table.recv_fwd, table.recv_bwd,
        res_slot)], axis=1)
