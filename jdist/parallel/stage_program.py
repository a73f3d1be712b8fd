"""What one (stage, replica) runs inside the pipeline's `shard_map`: every tick of the
schedule table (`jdist.parallel.schedule`), one operation per tick, then the two permutes.

A tick is nothing, a forward, or a backward of one micro-batch on one chunk of layers.
The chunk itself is the caller's `chunk_fn(v, block, shared, x, m, first, last) -> (y,
loss terms)`: it embeds on the first chunk and adds the loss on the last; this program only
schedules. A forward reads the chunk input from the stash; a backward recomputes the chunk
from it and pulls the micro-batch's cotangent back with `jax.vjp`, accumulating block and
shared gradients (in whatever layout the caller differentiates: jdist.parallel.grad_sync).
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
from jdist.parallel import schedule as sched


def program(blocks, shared, *, table: sched.Schedule, chunk_fn: Callable, act_shape: tuple,
            act_dtype, n_terms: int, train: bool):
    """One (stage, replica)'s share of the step: run every tick of `table`. `blocks` holds
    this stage's chunks stacked [virtual * layers per chunk, ...] (what is differentiated).
    Returns (loss terms summed over micro-batches / M, and when training (block grads,
    shared grads) of this stage; shared grads are nonzero only where a chunk used them)."""
    stages, virtual, micro = table.stages, table.virtual, table.micro
    last_chunk = stages * virtual - 1
    stage = jax.lax.axis_index(ax.STAGE)
    chunks = jax.tree.map(lambda b: b.reshape(virtual, -1, *b.shape[1:]), blocks)
    act = jnp.zeros(act_shape, act_dtype)
    no_loss = jnp.zeros(n_terms, jnp.float32)
    cyclic = virtual > 1  # the last stage's chunk v feeds the first stage's chunk v+1
    to_next = [(i, (i + 1) % stages) for i in range(stages if cyclic else stages - 1)]
    to_prev = [(j, i) for i, j in to_next]

    def tick(carry, row):
        stash, grads_in, acc, loss_sum = carry
        kind, m, v, in_slot, grad_slot, recv_fwd, recv_bwd = (row[i][stage] for i in range(7))
        c = v * stages + stage
        first, last = c == 0, c == last_chunk
        block = jax.tree.map(lambda b: b[v], chunks)
        x_in = stash[jnp.maximum(in_slot, 0)]
        f = lambda blk, sh, x: chunk_fn(v, blk, sh, x, m, first, last)

        def idle():
            return act, act, acc, no_loss

        def forward():
            y, loss = f(block, shared, x_in)
            return y, act, acc, loss

        def backward():  # recompute the chunk, then pull back this micro-batch's cotangent
            _, pullback = jax.vjp(f, block, shared, x_in)
            cot_y = jnp.where(last, act, grads_in[jnp.maximum(grad_slot, 0)])
            # The objective (term 0) of each micro-batch weighs 1/M in the step's mean.
            d_block, d_shared, d_x = pullback((cot_y, no_loss.at[0].set(1.0 / micro)))
            d_chunks = jax.tree.map(lambda a, g: a.at[v].add(g), acc[0], d_block)
            return act, d_x, (d_chunks, jax.tree.map(jnp.add, acc[1], d_shared)), no_loss

        ops = (idle, forward, backward) if train else (idle, forward)
        y, d_x, acc, loss = jax.lax.switch(kind, ops)
        stash = _store(stash, recv_fwd, jax.lax.ppermute(y, ax.STAGE, to_next))
        if train:
            grads_in = _store(grads_in, recv_bwd, jax.lax.ppermute(d_x, ax.STAGE, to_prev))
        return (stash, grads_in, acc, loss_sum + loss), None

    f32_zeros = lambda t: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), t)
    start = (jnp.zeros((table.n_slots, *act_shape), act_dtype),
             jnp.zeros((table.n_grad_slots, *act_shape), act_dtype) if train else (),
             (f32_zeros(chunks), f32_zeros(shared)) if train else (), no_loss)
    (_, _, acc, loss_sum), _ = jax.lax.scan(tick, start, jnp.asarray(_columns(table)))
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
    """The schedule as int32 [ticks, 7, stages]: kind, micro-batch, chunk and the slots."""
    kind = [[op.kind if op else sched.IDLE for op in row] for row in table.grid]
    micro = [[op.micro if op else 0 for op in row] for row in table.grid]
    chunk = [[op.chunk if op else 0 for op in row] for row in table.grid]
    return np.stack([np.array(x, np.int32) for x in (
        kind, micro, chunk, table.in_slot, table.grad_slot, table.recv_fwd, table.recv_bwd)],
        axis=1)
