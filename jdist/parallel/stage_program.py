"""What one (stage, data replica) runs inside the pipeline's `shard_map`: every tick of the
schedule table (`jdist.parallel.schedule`), one operation per tick, then the two permutes.

A tick is nothing, a forward, or a backward of one micro-batch on one chunk of layers. A
forward reads the chunk input from the stash (or embeds tokens, on the first chunk) and, on
the last chunk, computes the loss. A backward recomputes its chunk from the stashed input
and pulls the micro-batch's cotangent back with `jax.vjp`, accumulating block and shared
gradients. After the `lax.switch`, `ppermute`s pass the forward output to the next stage
and the input cotangent to the previous one; the table says which slot receives them.
Permutes stay outside the switch: see `jdist.parallel.ring_attention.Ring.shift` for what
a permute inside one stage's branch does on XLA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jdist import axes as ax
from jdist.parallel import schedule as sched
from jdist.parallel.context import ContextParallel, context_parallel
from jdist.parallel.layer_order import BLOCKS
from jdist.parallel.moe import (
    AUX_LOSS,
    DROPPED_FRACTION,
    LOAD_IMBALANCE,
    Z_LOSS,
    moe_losses,
)
from jdist.rules import activation_sharding, without_axis

if TYPE_CHECKING:
    from jdist.train.state import Plan


OBJECTIVE, CROSS_ENTROPY = "loss", "ce_loss"  # metrics keys, also of jdist.train.step


def loss_terms(model) -> tuple[str, ...]:
    """What each micro-batch's loss vector holds: the objective (differentiated), and for
    MoE models the cross-entropy and balancing losses the step reports, then the raw load
    sums `moe_metrics` turns into the dropped fraction and load imbalance."""
    if not model.n_experts:
        return (OBJECTIVE,)  # the cross-entropy itself
    return (OBJECTIVE, CROSS_ENTROPY, AUX_LOSS, Z_LOSS, _DROPPED, _ASSIGNED,
            *(f"{_LOAD}{e}" for e in range(model.n_experts)))


_DROPPED, _ASSIGNED, _LOAD = "dropped", "assigned", "load_of_expert_"  # raw sums, not reported


def moe_metrics(terms: dict) -> dict:
    """The step's metrics from the mean loss terms: the raw load sums become the dropped
    fraction and load imbalance over every layer and micro-batch (ratios of sums)."""
    if _DROPPED not in terms:  # a dense model
        return terms
    loads = jnp.stack([terms.pop(k) for k in [k for k in terms if k.startswith(_LOAD)]])
    dropped, assigned = terms.pop(_DROPPED), terms.pop(_ASSIGNED)
    return {**terms, DROPPED_FRACTION: dropped / assigned,
            LOAD_IMBALANCE: jnp.max(loads) / jnp.mean(loads)}


def moe_terms(model, stats: dict, ce: jax.Array) -> tuple[jax.Array, ...]:
    """A chunk's part of the micro-batch's `loss_terms` for an MoE model: the objective is
    the cross-entropy plus the weighted balancing losses. Each layer's loss needs its load
    fraction f_e over every data replica's tokens of the micro-batch (counts carry no
    gradient) and P_e, z over this replica's, as without a pipeline; the mean over layers
    becomes a sum of per-chunk shares."""
    total = jax.lax.psum(jax.lax.stop_gradient(stats), ax.DATA)
    balance = moe_losses(stats, total, model)
    share = stats["tokens"].shape[0] / model.n_layers  # this chunk's layers / all layers
    objective = ce + share * (model.aux_loss_weight * balance["aux_loss_local"]
                              + model.z_loss_weight * balance["z_loss_local"])
    return (objective, ce, share * balance[AUX_LOSS], share * balance[Z_LOSS],
            total["dropped"].sum(), total["tokens"].sum() * model.top_k,
            *total["counts"].sum(0))


def program(blocks, shared, inputs, targets, *, plan: Plan, table: sched.Schedule,
             compute_dtype, remat_block, train: bool):
    """One (stage, data replica)'s share of the step: run every tick of `table`."""
    stages, virtual, micro = table.stages, table.virtual, table.micro
    last_chunk = stages * virtual - 1
    stage = jax.lax.axis_index(ax.STAGE)
    chunks = jax.tree.map(lambda b: b.reshape(virtual, -1, *b.shape[1:]), blocks)
    inner_rules = without_axis(without_axis(plan.rules, ax.DATA), ax.STAGE)
    # Context parallelism inside a stage: tokens in the attention kernel's (load-balanced)
    # order, with their rotary positions, as `jdist.train.step.loss_and_metrics` does.
    cp = ContextParallel(plan.mesh, inner_rules, plan.cp_strategy)
    positions = cp.positions(inputs.shape[1])

    def reorder(x):  # the token ids whole first: see `_cross_entropy` for why
        if cp.balanced:
            x = jax.lax.with_sharding_constraint(x, PartitionSpec())
        return cp.reorder(x)

    tokens, labels = _split(reorder(inputs), micro), _split(reorder(targets), micro)
    act = jnp.zeros((*tokens.shape[1:], plan.model.d_model), compute_dtype)
    zero = jnp.zeros((), jnp.float32)
    moe = bool(plan.model.n_experts)
    no_loss = jnp.zeros(len(loss_terms(plan.model)), jnp.float32)
    cyclic = virtual > 1  # the last stage's chunk v feeds the first stage's chunk v+1
    to_next = [(i, (i + 1) % stages) for i in range(stages if cyclic else stages - 1)]
    to_prev = [(j, i) for i, j in to_next]

    def chunk_fn(block, shared_, x_in, tok, tgt, first, last):
        """Chunk forward: (output activation, this chunk's part of the micro-batch's
        `loss_terms`: the cross-entropy if last, MoE balancing terms of its layers)."""
        cast = lambda t: jax.tree.map(lambda p: p.astype(compute_dtype), t)
        model = nnx.merge(plan.graphdef, {**cast(shared_), BLOCKS: cast(block)})
        x = jax.lax.cond(first, lambda: model.embed_tokens(tok), lambda: x_in)
        y, stats = model.run_blocks(x, remat_block, positions)
        ce = jax.lax.cond(last, lambda: _cross_entropy(model.logits(y).astype(jnp.float32),
                                                       tgt).mean(), lambda: zero)
        return y, jnp.stack(moe_terms(plan.model, stats, ce) if moe else (ce,))

    def _cross_entropy(logits, labels):
        """optax.softmax_cross_entropy_with_integer_labels, bit for bit, but picking the
        label's logit with a select and a sum over vocab instead of a gather. In this
        stage-manual kernel, with two automatic axes of size > 1, XLA's SPMD partitioner
        (jax 0.10) aborts on a gather it splits along one and all-reduces along the other
        (CHECK in ExpandDeviceGroupsWithIota): here logits with batch over
        fsdp/expert/sequence and vocab over tensor; the ring's token reorder (a gather along
        `sequence`, next to tensor) too, so `reorder` takes the token ids whole. The sum
        adds exact zeros: the same value, and its gradient is the same one-hot scatter."""
        hit = labels[..., None] == jax.lax.broadcasted_iota(labels.dtype, logits.shape,
                                                            logits.ndim - 1)
        return jax.nn.logsumexp(logits, axis=-1) - jnp.where(hit, logits, 0.0).sum(-1)

    def tick(carry, row):
        stash, grads_in, acc, loss_sum = carry
        kind, m, v, in_slot, grad_slot, recv_fwd, recv_bwd = (row[i][stage] for i in range(7))
        c = v * stages + stage
        first, last = c == 0, c == last_chunk
        block = jax.tree.map(lambda b: b[v], chunks)
        x_in = stash[jnp.maximum(in_slot, 0)]
        f = lambda blk, sh, x: chunk_fn(blk, sh, x, tokens[m], labels[m], first, last)

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
    start = (jnp.zeros((table.n_slots, *act.shape), compute_dtype),
             jnp.zeros((table.n_grad_slots, *act.shape), compute_dtype) if train else (),
             (f32_zeros(chunks), f32_zeros(shared)) if train else (), no_loss)
    with activation_sharding(plan.mesh, inner_rules), \
            context_parallel(plan.mesh, inner_rules, plan.cp_strategy):
        (_, _, acc, loss_sum), _ = jax.lax.scan(tick, start, jnp.asarray(_columns(table)))
    if not train:  # only the last stage saw losses
        return jax.lax.psum(loss_sum / micro, ax.STAGE)[None]
    # Only the first (embedding) and last (head) stages have shared gradients: one sum over
    # stage makes them whole and replicated, with the loss.
    d_chunks, d_shared = acc
    loss, d_shared = jax.lax.psum((loss_sum / micro, d_shared), ax.STAGE)
    d_blocks = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), d_chunks)
    lead = lambda t: jax.tree.map(lambda g: g[None], t)
    return loss[None], (lead(d_blocks), lead(d_shared))


def _split(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...] taking every n-th row (rows stay on their fsdp shard)."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


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
