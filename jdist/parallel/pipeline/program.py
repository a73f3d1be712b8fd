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

The code: `program` traces what every tick shares once (`_Stage`), then scans
`_Stage.tick` over the table's columns. A tick reads its row (`_Op`), runs one of
`_Op.idle`, `forward`, `backward`, `weights` in the switch, passes its outputs on
(`_pass_on`) and writes what it stashes (`_keep`). The order in which these trace their
operations is the order of the HLO: keep it when editing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.models.precision import accumulator
from jdist.parallel.pipeline import residuals
from jdist.parallel.pipeline import schedule as sched
from jdist.spmd import axes as ax


def program(blocks, shared, *, table: sched.Schedule, chunk_fn: Callable, act_shape: tuple,
            act_dtype, n_terms: int, train: bool, stash_residuals: bool = False,
            by_chunk: bool = False):
    """One (stage, replica)'s share of the step: run every tick of `table`. `blocks` holds
    this stage's chunks stacked [virtual * layers per chunk, ...] (what is differentiated);
    `by_chunk`: a tuple of each chunk's own tree instead, of shapes of its own (a
    heterogeneous stack's runs, `models.runs`), all handed to `chunk_fn`, which picks.
    `stash_residuals` needs a `table` built with `stash`. Returns (loss terms summed over
    micro-batches / M, and when training (block grads, shared grads) of this stage; shared
    grads are nonzero only where a chunk used them)."""
    st = _stage(blocks, shared, table, chunk_fn, act_shape, act_dtype, n_terms, train,
                stash_residuals and train, by_chunk)
    start = _start(st, act_shape, act_dtype)
    (_, _, _, acc, loss_sum), _ = jax.lax.scan(st.tick, start, jnp.asarray(_columns(table)))
    if not train:
        return loss_sum / table.micro
    d_chunks, d_shared = acc
    d_blocks = d_chunks if by_chunk else \
        jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), d_chunks)
    return loss_sum / table.micro, (d_blocks, d_shared)


@dataclasses.dataclass(frozen=True, eq=False)
class _Stage:
    """What every tick of one call shares: the call's settings, and values traced once
    before the scan (this stage's index and chunks, zeros, the residual split)."""

    table: sched.Schedule
    chunk_fn: Callable
    params_def: Any            # the tree of (blocks, shared): the chunk's params flattened
    train: bool
    to_next: list              # ppermute pairs: up a stage, and down
    to_prev: list
    used: frozenset            # the sources anything ever arrives by
    stage: jax.Array           # traced: axis_index(STAGE)
    chunks: Any                # blocks as [virtual, layers per chunk, ...] (by_chunk: as given)
    shared: Any
    act: jax.Array             # zeros of one micro-batch's activation
    no_loss: jax.Array         # zeros of the loss terms
    split: residuals.Split | None = None  # with stash_residuals: the chunk's forward split
    halves: Any = None         # and its backward in two halves (zero-bubble tables)
    by_input: tuple = ()       # per stashed residual: read by the backward (else by W only)
    nothing: tuple = ((), (), ())  # a tick's stash writes when it stashes nothing
    by_chunk: bool = False     # `program`'s: every chunk's tree handed over, whole

    @property
    def vshape(self) -> bool:
        return self.table.name in sched.V_SHAPED

    def f(self, where, p, x, m):  # the chunk on flat arrays (jdist.parallel.pipeline.residuals)
        v, first, last = where
        return self.chunk_fn(v, *jax.tree.unflatten(self.params_def, p), x, m, first, last)

    def where_of(self, v):
        """The chunk a tick runs, and whether it is the first or the last."""
        c = v * self.table.stages + self.stage  # sched.chunk_index, on a traced stage
        if self.vshape:
            c = jnp.where(v == 1, 2 * self.table.stages - 1 - self.stage, c)
        return [v, c == 0, c == self.table.stages * self.table.virtual - 1]

    def chunk_params(self, v) -> list:
        blocks = self.chunks if self.by_chunk else jax.tree.map(lambda b: b[v], self.chunks)
        return jax.tree.leaves((blocks, self.shared))

    def tick(self, carry, row):
        """One column of the table at this stage: its operation, then the permutes."""
        stash, grads_in, kept, acc, loss_sum = carry
        op = _Op.of_row(self, row, stash, grads_in, kept, acc)
        ops = (op.idle, op.forward, op.backward, op.weights)
        y, d_x, acc, loss, writes = jax.lax.switch(
            op.kind, ops[:4 if self.halves else 3 if self.train else 2])
        stash, grads_in = _pass_on(self, op, y, d_x, stash, grads_in)
        kept = _keep(kept, op, writes)
        return (stash, grads_in, kept, acc, loss_sum + loss), None


def _stage(blocks, shared, table: sched.Schedule, chunk_fn: Callable, act_shape: tuple,
           act_dtype, n_terms: int, train: bool, stash: bool, by_chunk: bool) -> _Stage:
    """Trace what the ticks share, once; with `stash`, split the chunk's forward from its
    backward (`residuals.split`)."""
    stage = jax.lax.axis_index(ax.STAGE)
    chunks = blocks if by_chunk else \
        jax.tree.map(lambda b: b.reshape(table.virtual, -1, *b.shape[1:]), blocks)
    act = jnp.zeros(act_shape, act_dtype)
    no_loss = jnp.zeros(n_terms, accumulator(act_dtype))
    to_next, to_prev = _neighbours(table)
    st = _Stage(table, chunk_fn, jax.tree.structure((blocks, shared)), train, to_next,
                to_prev, _sources_used(table), stage, chunks, shared, act, no_loss,
                by_chunk=by_chunk)
    # Traced once for all ticks: chunks differ only in the (traced) chunk index.
    zero = jnp.zeros((), jnp.int32)
    split = residuals.split(st.f, st.where_of(zero), st.chunk_params(zero), act, zero) \
        if stash else None
    halves = split.halves() if split and table.split_backward else None
    by_input, nothing = _stash_zeros(split, halves)
    return dataclasses.replace(st, split=split, halves=halves, by_input=by_input,
                               nothing=nothing)


def _neighbours(table: sched.Schedule) -> tuple[list, list]:
    """The ppermute pairs (source, destination) up to the next stage and down to the
    previous one."""
    # Interleaved, the last stage's chunk v feeds the first stage's chunk v+1.
    cyclic = table.virtual > 1 and table.name not in sched.V_SHAPED
    stages = table.stages
    to_next = [(i, (i + 1) % stages) for i in range(stages if cyclic else stages - 1)]
    return to_next, [(j, i) for i, j in to_next]


def _sources_used(table: sched.Schedule) -> frozenset:
    """The sources (`sched.SOURCES`) anything ever arrives by."""
    return frozenset(source for source in sched.SOURCES
                     if any(slot >= 0 for recv in (table.recv_fwd, table.recv_bwd)
                            for row in recv[source] for slot in row))


def _zeros(avals) -> list:
    return [jnp.zeros(a.shape, a.dtype) for a in avals]


def _stash_zeros(split, halves) -> tuple[list, tuple]:
    """Which stashed residuals the backward reads (`by_input`), and what waits between
    ticks besides activations, as zeros of one micro-batch: the forward's residuals only
    the backward reads (F -> B, `res_slot`); split, those the weight gradient reads
    (F -> W, `w_slot`) and the backward's hand-over (B -> W, `h_slot`)."""
    stashed = split.stash_avals() if split else []
    by_input = [not w for w, s in zip(halves.w_reads, split.stashed) if s] if halves else \
        [True] * len(stashed)
    nothing = (_zeros(a for a, b in zip(stashed, by_input) if b),
               _zeros(a for a, b in zip(stashed, by_input) if not b),
               _zeros(halves.handover_avals() if halves else []))
    return by_input, nothing


def _start(st: _Stage, act_shape: tuple, act_dtype) -> tuple:
    """The scan's first carry: (activation stash, cotangent stash, stashed residuals and
    hand-overs, float32 gradients, loss terms), all zeros. Each residual buffer has a spare
    last row (`_keep`)."""
    table = st.table
    f32_zeros = lambda t: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), t)
    kept = tuple([jnp.zeros((n + 1, *x.shape), x.dtype) for x in group] for n, group in zip(
        (table.n_res_slots, table.n_w_slots, table.n_h_slots), st.nothing))
    return (jnp.zeros((table.n_slots, *act_shape), act_dtype),
            jnp.zeros((table.n_grad_slots, *act_shape), act_dtype) if st.train else (),
            kept, (f32_zeros(st.chunks), f32_zeros(st.shared)) if st.train else (),
            st.no_loss)


def _read(buffers: list, slot) -> list:
    return [b[jnp.maximum(slot, 0)] for b in buffers]


@dataclasses.dataclass(frozen=True, eq=False)
class _Op:
    """One tick's operation at this stage: its row of the table (traced), and the carry it
    reads. Each branch of the switch returns (output up, cotangent down, gradients, loss
    terms, stash writes)."""

    st: _Stage
    kind: jax.Array
    m: jax.Array
    v: jax.Array
    in_slot: jax.Array
    grad_slot: jax.Array
    res_slot: jax.Array
    w_slot: jax.Array
    h_slot: jax.Array
    recv: list                 # per source, the slot an activation then a cotangent goes to
    where: list                # where_of(v)
    p: list                    # chunk_params(v)
    x_in: jax.Array            # the chunk input, from the stash
    grads_in: Any
    kept: tuple
    acc: Any

    @classmethod
    def of_row(cls, st: _Stage, row, stash, grads_in, kept, acc) -> _Op:
        kind, m, v, in_slot, grad_slot, res_slot, w_slot, h_slot, *recv = (
            row[i][st.stage] for i in range(len(row)))
        where, p = st.where_of(v), st.chunk_params(v)
        x_in = stash[jnp.maximum(in_slot, 0)]
        return cls(st, kind, m, v, in_slot, grad_slot, res_slot, w_slot, h_slot, recv,
                   where, p, x_in, grads_in, kept, acc)

    def idle(self):
        st = self.st
        return st.act, st.act, self.acc, st.no_loss, st.nothing

    def forward(self):
        st = self.st
        if not st.split:
            y, loss = st.f(self.where, self.p, self.x_in, self.m)
            return y, st.act, self.acc, loss, st.nothing
        y, loss, res = st.split.forward([*self.where, *self.p], self.x_in, self.m)
        return y, st.act, self.acc, loss, ([r for r, b in zip(res, st.by_input) if b],
                                           [r for r, b in zip(res, st.by_input) if not b],
                                           st.nothing[2])

    def backward(self):
        """Pull back this micro-batch's cotangent."""
        st = self.st
        cot_y = jnp.where(self.where[2], st.act, self.grads_in[jnp.maximum(self.grad_slot, 0)])
        # The objective (term 0) of each micro-batch weighs 1/M in the step's mean.
        cot = (cot_y, st.no_loss.at[0].set(1.0 / st.table.micro))
        if st.halves:  # the input's gradient now, the weights' in their WGT tick
            early, handover = st.halves.input_half(self._stashed_now(), cot)
            *d_p, d_x = st.halves.merge(early, self._zero_grads(early=False))
            return st.act, d_x, self._accumulate(d_p), st.no_loss, (*st.nothing[:2], handover)
        if st.split:
            pullback = st.split.pullback([*self.where, *self.p], _read(self.kept[0],
                                                                       self.res_slot))
        else:  # recompute the chunk from its input
            _, pullback = jax.vjp(lambda p, x: st.f(self.where, p, x, self.m), self.p,
                                  self.x_in)
        d_p, d_x = pullback(cot)
        return st.act, d_x, self._accumulate(d_p), st.no_loss, st.nothing

    def weights(self):
        """A split backward's weight gradients, from its hand-over."""
        st = self.st
        late = st.halves.weight_half(_read(self.kept[2], self.h_slot), self._stashed_now())
        *d_p, _ = st.halves.merge(self._zero_grads(early=True), late)
        return st.act, st.act, self._accumulate(d_p), st.no_loss, st.nothing

    def _stashed_now(self) -> list:
        """Every stashed residual this tick can read, None where not."""
        mine = iter(_read(self.kept[0], self.res_slot))
        theirs = iter(_read(self.kept[1], self.w_slot))
        return self.st.split.residuals([*self.where, *self.p], [
            next(mine) if b else next(theirs) for b in self.st.by_input])

    def _zero_grads(self, early: bool) -> list:
        """Zeros for the backward outputs the other half computes (`early`: the input
        half's)."""
        st = self.st
        return [jnp.zeros(o.aval.shape, o.aval.dtype) for o, e in zip(
            st.split.backward.outvars, st.halves.early) if e == early]

    def _accumulate(self, d_p):
        d_block, d_shared = jax.tree.unflatten(self.st.params_def, d_p)
        add = jnp.add if self.st.by_chunk else (lambda a, g: a.at[self.v].add(g))
        d_chunks = jax.tree.map(add, self.acc[0], d_block)
        return d_chunks, jax.tree.map(jnp.add, self.acc[1], d_shared)


def _pass_on(st: _Stage, op: _Op, y, d_x, stash, grads_in) -> tuple:
    """Permute what the tick produced, and store what arrives in the slots the table
    names: (stash, grads_in)."""
    # What goes up and what goes down: the V's second chunk reverses both directions.
    flip = (op.v == 1) if st.vshape else False
    up, down = jnp.where(flip, d_x, y), jnp.where(flip, y, d_x)
    for source, fwd_slot, bwd_slot in zip(sched.SOURCES, op.recv[:3], op.recv[3:]):
        if source in st.used:  # a permute nothing ever arrives by is not even traced
            value = _arriving(st, source, up, down)
            stash = _store(stash, fwd_slot, value)
            if st.train:
                grads_in = _store(grads_in, bwd_slot, value)
    return stash, grads_in


def _arriving(st: _Stage, source: int, up, down):
    if source == sched.BELOW:
        return jax.lax.ppermute(up, ax.STAGE, st.to_next)
    if source == sched.ABOVE:
        return jax.lax.ppermute(down, ax.STAGE, st.to_prev)
    return up  # sched.SELF, the V's turn: the last stage's own output


def _keep(kept: tuple, op: _Op, writes: tuple) -> tuple:
    """The stashed residuals and hand-overs with this tick's writes: a forward's into its
    res and w slots, a backward's hand-over into its h slot."""
    slots = (jnp.where(op.kind == sched.FWD, op.res_slot, -1),
             jnp.where(op.kind == sched.FWD, op.w_slot, -1),
             jnp.where(op.kind == sched.BWD, op.h_slot, -1))
    # A tick that writes nothing writes its zeros to the spare last row: an update in
    # place, where a select would read and copy a slot's worth each tick.
    return tuple([jax.lax.dynamic_update_index_in_dim(
        b, x, jnp.where(slot >= 0, slot, b.shape[0] - 1), 0) for b, x in zip(buffers, values)]
                 for buffers, slot, values in zip(kept, slots, writes))


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
