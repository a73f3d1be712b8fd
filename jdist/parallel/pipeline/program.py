"""What one (stage, replica) runs inside the pipeline's `shard_map`: every tick of the
schedule table (`jdist.parallel.pipeline.schedule`), one operation per tick, then the two permutes.

A tick is nothing, a forward, or a backward of one micro-batch on one chunk of layers.
The chunk itself is the caller's `chunk_fn(v, block, shared, x, m, first, last) -> (y,
loss terms)`: it embeds on the first chunk and adds the loss on the last; this program only
schedules. A forward reads the chunk input from the stash. A backward pulls the
micro-batch's cotangent back through the chunk, accumulating block and shared gradients (in
whatever layout the caller differentiates: jdist.parallel.grad_sync), from one of two
sources. With `stash_residuals` (any `--remat` but full) the forward kept what the backward
reads, as the layer's remat policy decides (`jdist.parallel.pipeline.residuals`): the same FLOPs as
an unpipelined step, residuals of the in-flight micro-batches held. Without, the backward
recomputes the chunk from its stashed input (`jax.vjp`): only chunk inputs are held, and
every chunk's forward runs twice.
After the `lax.switch`, one `ppermute` passes what the tick produced up to the next stage
and one down to the previous: a forward's output goes up and a backward's input cotangent
down, except on the V shape's second chunk (ZB-V), which runs from the last stage back to
the first, and whose last stage hands its first chunk's output to itself. The table says,
per source, which slot receives what. Permutes stay outside the switch: see
`jdist.parallel.attention.ring.Ring.shift` for what a permute inside one stage's branch
does on XLA.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdist.models.precision import accumulator
from jdist.parallel.pipeline import residuals
from jdist.parallel.pipeline import schedule as sched
from jdist.spmd import axes as ax


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
    no_loss = jnp.zeros(n_terms, accumulator(act_dtype))
    vshape = table.name in sched.V_SHAPED
    # Interleaved, the last stage's chunk v feeds the first stage's chunk v+1.
    cyclic = virtual > 1 and not vshape
    to_next = [(i, (i + 1) % stages) for i in range(stages if cyclic else stages - 1)]
    to_prev = [(j, i) for i, j in to_next]

    params_def = jax.tree.structure((blocks, shared))
    chunk_params = lambda v: jax.tree.leaves((jax.tree.map(lambda b: b[v], chunks), shared))

    def f(where, p, x, m):  # the chunk on flat arrays (jdist.parallel.pipeline.residuals)
        v, first, last = where
        return chunk_fn(v, *jax.tree.unflatten(params_def, p), x, m, first, last)

    def where_of(v):  # the chunk a tick runs, and whether it is the first or the last
        c = v * stages + stage  # sched.chunk_index, on a traced stage
        if vshape:
            c = jnp.where(v == 1, 2 * stages - 1 - stage, c)
        return [v, c == 0, c == last_chunk]

    # Traced once for all ticks: chunks differ only in the (traced) chunk index.
    zero = jnp.zeros((), jnp.int32)
    split = residuals.split(f, where_of(zero), chunk_params(zero), act, zero) \
        if stash_residuals and train else None
    halves = split.halves() if split and table.split_backward else None
    # What waits between ticks besides activations, as zeros of one micro-batch: the
    # forward's residuals only the backward reads (F -> B, `res_slot`); split, those the
    # weight gradient reads (F -> W, `w_slot`) and the backward's hand-over (B -> W,
    # `h_slot`).
    stashed = split.stash_avals() if split else []
    by_input = [not w for w, s in zip(halves.w_reads, split.stashed) if s] if halves else \
        [True] * len(stashed)
    zeros = lambda avals: [jnp.zeros(a.shape, a.dtype) for a in avals]
    nothing = (zeros(a for a, b in zip(stashed, by_input) if b),
               zeros(a for a, b in zip(stashed, by_input) if not b),
               zeros(halves.handover_avals() if halves else []))

    used = {source for source in sched.SOURCES  # the sources anything arrives by
            if any(slot >= 0 for recv in (table.recv_fwd, table.recv_bwd)
                   for row in recv[source] for slot in row)}

    def tick(carry, row):
        stash, grads_in, kept, acc, loss_sum = carry
        kind, m, v, in_slot, grad_slot, res_slot, w_slot, h_slot, *recv = (
            row[i][stage] for i in range(len(row)))
        where, p = where_of(v), chunk_params(v)
        last = where[2]
        x_in = stash[jnp.maximum(in_slot, 0)]
        read = lambda buffers, slot: [b[jnp.maximum(slot, 0)] for b in buffers]

        def stashed_now():  # every stashed residual this tick can read, None where not
            mine, theirs = iter(read(kept[0], res_slot)), iter(read(kept[1], w_slot))
            return split.residuals([*where, *p], [next(mine) if b else next(theirs)
                                                  for b in by_input])

        def idle():
            return act, act, acc, no_loss, nothing

        def forward():
            if not split:
                y, loss = f(where, p, x_in, m)
                return y, act, acc, loss, nothing
            y, loss, res = split.forward([*where, *p], x_in, m)
            return y, act, acc, loss, ([r for r, b in zip(res, by_input) if b],
                                       [r for r, b in zip(res, by_input) if not b],
                                       nothing[2])

        def accumulate(d_p):
            d_block, d_shared = jax.tree.unflatten(params_def, d_p)
            d_chunks = jax.tree.map(lambda a, g: a.at[v].add(g), acc[0], d_block)
            return d_chunks, jax.tree.map(jnp.add, acc[1], d_shared)

        def backward():  # pull back this micro-batch's cotangent
            cot_y = jnp.where(last, act, grads_in[jnp.maximum(grad_slot, 0)])
            # The objective (term 0) of each micro-batch weighs 1/M in the step's mean.
            cot = (cot_y, no_loss.at[0].set(1.0 / micro))
            if halves:  # the input's gradient now, the weights' in their WGT tick
                early, handover = halves.input_half(stashed_now(), cot)
                late = [jnp.zeros(o.aval.shape, o.aval.dtype) for o, e in zip(
                    split.backward.outvars, halves.early) if not e]
                *d_p, d_x = halves.merge(early, late)
                return act, d_x, accumulate(d_p), no_loss, (*nothing[:2], handover)
            if split:
                pullback = split.pullback([*where, *p], read(kept[0], res_slot))
            else:  # recompute the chunk from its input
                _, pullback = jax.vjp(lambda p, x: f(where, p, x, m), p, x_in)
            d_p, d_x = pullback(cot)
            return act, d_x, accumulate(d_p), no_loss, nothing

        def weights():  # a split backward's weight gradients, from its hand-over
            late = halves.weight_half(read(kept[2], h_slot), stashed_now())
            early = [jnp.zeros(o.aval.shape, o.aval.dtype) for o, e in zip(
                split.backward.outvars, halves.early) if e]
            *d_p, _ = halves.merge(early, late)
            return act, act, accumulate(d_p), no_loss, nothing

        ops = (idle, forward, backward, weights)[:4 if halves else 3 if train else 2]
        y, d_x, acc, loss, writes = jax.lax.switch(kind, ops)
        # What goes up and what goes down: the V's second chunk reverses both directions.
        flip = (v == 1) if vshape else False
        up, down = jnp.where(flip, d_x, y), jnp.where(flip, y, d_x)
        arriving = {sched.BELOW: lambda: jax.lax.ppermute(up, ax.STAGE, to_next),
                    sched.ABOVE: lambda: jax.lax.ppermute(down, ax.STAGE, to_prev),
                    sched.SELF: lambda: up}  # the V's turn: the last stage's own output
        for source, fwd_slot, bwd_slot in zip(sched.SOURCES, recv[:3], recv[3:]):
            if source in used:  # a permute nothing ever arrives by is not even traced
                value = arriving[source]()
                stash = _store(stash, fwd_slot, value)
                if train:
                    grads_in = _store(grads_in, bwd_slot, value)
        slots = (jnp.where(kind == sched.FWD, res_slot, -1),
                 jnp.where(kind == sched.FWD, w_slot, -1),
                 jnp.where(kind == sched.BWD, h_slot, -1))
        # A tick that writes nothing writes its zeros to the spare last row: an update in
        # place, where a select would read and copy a slot's worth each tick.
        kept = tuple([jax.lax.dynamic_update_index_in_dim(
            b, x, jnp.where(slot >= 0, slot, b.shape[0] - 1), 0) for b, x in zip(buffers, values)]
                     for buffers, slot, values in zip(kept, slots, writes))
        return (stash, grads_in, kept, acc, loss_sum + loss), None

    f32_zeros = lambda t: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), t)
    kept = tuple([jnp.zeros((n + 1, *x.shape), x.dtype) for x in group] for n, group in zip(
        (table.n_res_slots, table.n_w_slots, table.n_h_slots), nothing))
    start = (jnp.zeros((table.n_slots, *act_shape), act_dtype),
             jnp.zeros((table.n_grad_slots, *act_shape), act_dtype) if train else (),
             kept, (f32_zeros(chunks), f32_zeros(shared)) if train else (), no_loss)
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
    """The schedule as int32 [ticks, 14, stages]: kind, micro-batch, chunk, the slots read
    and written (in, grad, res, w, h), and where what arrives is stored, activations then
    cotangents, per source (`sched.SOURCES`)."""
    kind = [[op.kind if op else sched.IDLE for op in row] for row in table.grid]
    micro = [[op.micro if op else 0 for op in row] for row in table.grid]
    chunk = [[op.chunk if op else 0 for op in row] for row in table.grid]
    none = [[-1] * table.stages for _ in table.grid]
    return np.stack([np.array(x, np.int32) for x in (
        kind, micro, chunk, table.in_slot, table.grad_slot, table.res_slot or none,
        table.w_slot or none, table.h_slot or none, *table.recv_fwd, *table.recv_bwd)],
        axis=1)
