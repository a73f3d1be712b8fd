"""Vocabulary-parallel output loss: cross-entropy from the hidden states and the head
weight, over chunks of the vocabulary, without ever holding [tokens, vocab] logits.

Inside a `shard_map` each device holds its slice of the vocabulary (the head sharded over
`tensor`, or whatever the rules give `vocab`) and all its tokens. The forward walks vocab
chunks with an online log-sum-exp; max and sum-exp are then reduced over the vocab axes,
and so is the label's logit, picked by the device that holds that row. The custom VJP walks
the chunks again: probabilities recomputed from the saved log-sum-exp, each chunk's block
of the weight gradient written in one matmul, the hidden-state gradient accumulated in
float32 and summed over the vocab axes.

Why chunks of vocabulary and not of tokens: a token chunk contributes to every column of
dW, so the weight gradient would be summed over chunks in a float32 buffer the size of the
head (2.1 GB at 8B) or rounded to bf16 once per chunk; a vocab chunk's columns of dW come
out of one matmul that accumulates in float32, exactly as without chunking.
Peak: [tokens, chunk] float32 blocks (`CHUNK_BYTES`) plus [tokens, embed] float32.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jdist.models.precision import accumulator
from jdist.parallel import CHECK_VMA, kernel_mesh
from jdist.parallel import grad_sync as gs
from jdist.spmd.rules import mesh_axes_of
from jdist.spmd.varying import varying, vma

# Bytes of one float32 [tokens, chunk] logits block: bounds the loss's temporaries (a few
# such blocks are live) whatever the vocabulary.
CHUNK_BYTES = 32 * 2**20


def chunk_size(n_tokens: int, vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Vocabulary rows per chunk: the largest divisor of `vocab` whose float32 [n_tokens,
    chunk] block fits `budget`; if that is under half the rows the budget allows (a vocab
    like 50257 = 29 x 1733), the rows the budget allows, the last chunk overlapping the one
    before it and counting only its new rows (`_fresh`)."""
    limit = max(1, budget // (4 * max(n_tokens, 1)))
    if limit >= vocab:
        return vocab
    best = max(d for d in range(1, limit + 1) if vocab % d == 0)
    return best if 2 * best >= limit else limit


@dataclasses.dataclass(frozen=True)
class Head:
    """How the loss reads the output weight (static, hashable): its vocab dimension, the
    mesh axes the vocabulary and the tokens are split over inside the kernel, the chunk,
    and the replica-axis `Sync` of the stored block (gathered chunk by chunk)."""

    vocab_dim: int
    vocab_axes: tuple[str, ...]
    token_axes: tuple[str, ...]
    chunk: int
    sync: gs.Sync
    dtype: Any
    defer: bool = False


def _n_chunks(head: Head, local: int) -> int:
    return -(-local // head.chunk)


def _start(head: Head, local: int, i):
    """First vocabulary row of chunk i: the last chunk ends at the last row."""
    return jnp.minimum(i * head.chunk, local - head.chunk)


def _fresh(head: Head, local: int, i, start):
    """Which of chunk i's rows no earlier chunk covered ([chunk] booleans), or None when
    the chunks tile the vocabulary exactly."""
    if local % head.chunk == 0:
        return None
    return start + jnp.arange(head.chunk) >= i * head.chunk


def _weight_chunk(head: Head, stored, start):
    """Vocabulary rows start..start+chunk of the stored float32 block, gathered over the
    replica axes in the compute dtype: the whole head is never gathered at once. (Casting a
    chunk inside the loop, not the whole weight before it, also keeps the CPU backend, which
    runs bf16 dots in f32, from widening the whole head to f32 up front; jax 0.10.2.)"""
    w_c = lax.dynamic_slice_in_dim(stored, start, head.chunk, head.vocab_dim)
    return gs.gather(w_c, head.sync, head.dtype)


def _logits(head: Head, h, w_c, fresh):
    eq = "bse,ev->bsv" if head.vocab_dim == 1 else "bse,ve->bsv"
    logits = jnp.einsum(eq, h, w_c, preferred_element_type=accumulator(h))
    return logits if fresh is None else jnp.where(fresh, logits, -jnp.inf)


def _hits(head: Head, labels, local: int, start, fresh, shape):
    """Where the chunk at `start` holds each token's label (a one-hot [b, s, chunk] mask)."""
    offset = lax.axis_index(head.vocab_axes) * local if head.vocab_axes else 0
    rel = labels - offset - start
    hit = rel[..., None] == lax.broadcasted_iota(jnp.int32, shape, 2)
    return hit if fresh is None else hit & fresh


def _forward(head: Head, h, stored, labels):
    """(per-token cross-entropy [b, s], log-sum-exp [b, s])."""
    b, s = labels.shape
    local = stored.shape[head.vocab_dim]
    like = tuple({*vma(h), *vma(stored), *vma(labels)})
    start = tuple(varying(jnp.full((b, s), x, accumulator(h)), like) for x in (-jnp.inf, 0.0, 0.0))

    def body(carry, i, w_c):
        m, norm, picked = carry
        first = _start(head, local, i)
        fresh = _fresh(head, local, i, first)
        logits = _logits(head, h, w_c, fresh)
        new_m = jnp.maximum(m, logits.max(-1))
        norm = norm * jnp.exp(m - new_m) + jnp.exp(logits - new_m[..., None]).sum(-1)
        hit = _hits(head, labels, local, first, fresh, logits.shape)
        return new_m, norm, picked + jnp.where(hit, logits, 0.0).sum(-1)

    m, norm, picked = _over_chunks(body, start, head, stored)
    if head.vocab_axes:
        top = lax.pmax(m, head.vocab_axes)
        norm = lax.psum(norm * jnp.exp(m - top), head.vocab_axes)
        m, picked = top, lax.psum(picked, head.vocab_axes)
    lse = m + jnp.log(norm)
    return lse - picked, lse


def _backward(head: Head, with_weight: bool, h, primal, stored, labels, lse, g):
    """(dh, gradient of `primal`): each chunk's dW reduced as soon as it exists, in
    float32: over the token axes (sequence, expert), then over the replica axes as
    `grad_sync` reduces every parameter, into the gradient layout. Without `with_weight`
    (a frozen weight) dW is neither computed nor reduced: (dh, a scalar 0)."""
    local = stored.shape[head.vocab_dim]
    g = g.astype(accumulator(h))
    eq_h = "bsv,ev->bse" if head.vocab_dim == 1 else "bsv,ve->bse"
    eq_w = "bse,bsv->ev" if head.vocab_dim == 1 else "bse,bsv->ve"

    def body(carry, i, w_c):
        dh, dw = carry
        first = _start(head, local, i)
        fresh = _fresh(head, local, i, first)
        logits = _logits(head, h, w_c, fresh)
        hit = _hits(head, labels, local, first, fresh, logits.shape)
        dlogits = ((jnp.exp(logits - lse[..., None]) - hit) * g[..., None]).astype(h.dtype)
        dh = dh + jnp.einsum(eq_h, dlogits, w_c, preferred_element_type=g.dtype)
        if not with_weight:
            return dh, dw
        dw_c = jnp.einsum(eq_w, h, dlogits, preferred_element_type=g.dtype)
        if head.token_axes:
            dw_c = lax.psum(dw_c, head.token_axes)
        dw_c = gs.reduce(dw_c, head.sync, head.defer).astype(primal.dtype)
        if fresh is not None:  # the overlap already holds the earlier chunk's rows (+ 0 here)
            dw_c = dw_c + lax.dynamic_slice_in_dim(dw, first, head.chunk, head.vocab_dim)
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c, first, head.vocab_dim)
        return dh, dw

    like = tuple({*vma(h), *vma(stored), *vma(labels)})
    # dW chunks are summed over the token axes: the gradient varies only as the weight does.
    dw = varying(jnp.zeros(primal.shape, primal.dtype), (*vma(stored), *vma(primal))) \
        if with_weight else jnp.zeros((), primal.dtype)  # a frozen weight: a placeholder
    start = (varying(jnp.zeros(h.shape, g.dtype), like), dw)
    dh, dw = _over_chunks(body, start, head, stored, reverse=True)
    if head.vocab_axes:  # every vocab slice contributed to each token's hidden-state gradient
        dh = lax.psum(dh, head.vocab_axes)
    return dh.astype(h.dtype), dw


def _over_chunks(body, start, head: Head, stored, reverse: bool = False):
    """`body(carry, i, weight chunk i) -> carry` over the chunks (last to first with
    `reverse`), the next chunk gathered while chunk i computes (the last iteration gathers
    its chunk again: a loop body cannot skip a collective without a conditional, which
    would end the overlap); no loop for a single chunk. The backward runs in reverse so that
    its first gather is not the forward's: XLA's GPU compiler merges identical gathers and
    keeps the value alive in between, the CPU's too (jax 0.10.2)."""
    local = stored.shape[head.vocab_dim]
    n = _n_chunks(head, local)
    fetch = lambda i: _weight_chunk(head, stored, _start(head, local, i))
    if n == 1:
        return body(start, 0, fetch(0))

    def step(carry, i):
        carry, w_c = carry
        upcoming = jnp.maximum(i - 1, 0) if reverse else jnp.minimum(i + 1, n - 1)
        return (body(carry, i, w_c), fetch(upcoming)), None

    (out, _), _ = lax.scan(step, (start, fetch(n - 1 if reverse else 0)), jnp.arange(n),
                           reverse=reverse)
    return out


def vocab_parallel_cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *,
                                 vocab_dim: int, mesh, h_spec, w_spec, label_spec,
                                 sync: gs.Sync | None = None, primal: jax.Array | None = None,
                                 defer: bool = False, frozen: bool = False,
                                 chunk_bytes: int = CHUNK_BYTES) -> jax.Array:
    """Per-token -log softmax(h @ w)[label], float32 [b, s], exact. h [b, s, embed] (its
    spec must not use the vocab axes), w [embed, vocab] (`vocab_dim` 1) or [vocab, embed]
    (0, a tied table), labels [b, s] global ids.

    With `sync` (inside the step's replica shard_map), `w` is the stored float32 block of
    the weight and `primal` its gradient-layout block (`grad_sync.to_grad_layout`), which
    receives the reduced float32 gradient: each chunk of rows is gathered over the replica
    axes when used and its gradient reduced right away. Without, `w` is used as it is.
    `frozen`: the weight gets no gradient (LoRA's base): the backward computes only dh,
    with no dW chunk and no reduction of one."""
    def split(spec, *dims):  # mesh axes (of size > 1) that split these dims of `spec`
        entries = tuple(spec) + (None,) * 3
        return tuple(a for d in dims for a in mesh_axes_of(entries[d]) if mesh.shape[a] > 1)

    vocab_axes, token_axes = split(w_spec, vocab_dim), split(label_spec, 0, 1)
    n = math.prod(mesh.shape[a] for a in vocab_axes)
    local_tokens = labels.size // math.prod(mesh.shape[a] for a in token_axes)
    if sync is None:
        sync = gs.Sync(((),) * 2, ((),) * 2, (), 1, cast=True)
    head = Head(vocab_dim, vocab_axes, token_axes,
                chunk_size(local_tokens, w.shape[vocab_dim] // n, chunk_bytes),
                dataclasses.replace(sync, cast=True), jnp.dtype(h.dtype), defer)
    # The custom VJP sits outside the two kernels (as in ring attention), so neither is
    # transposed by autodiff: each reduction in them is the one written here. Gathering over
    # the replica axes of the unchecked shard_map around them would type their outputs as
    # varying over those axes, which cotangents from that map are not (jax 0.10.2), so
    # there they run unchecked too.
    replica = any(sync.stored) or any(sync.grad) or bool(sync.reduce)
    smap = partial(jax.shard_map, **kernel_mesh(mesh), check_vma=CHECK_VMA and not replica)
    fwd = smap(partial(_forward, head), in_specs=(h_spec, w_spec, label_spec),
               out_specs=(label_spec, label_spec))
    bwd = smap(partial(_backward, head, not frozen),
               in_specs=(h_spec, w_spec, w_spec, label_spec, label_spec, label_spec),
               out_specs=(h_spec, w_spec) if not frozen else (h_spec, PartitionSpec()))

    @jax.custom_vjp
    def loss(h, primal, stored, labels):
        return fwd(h, stored, labels)[0]

    def loss_fwd(h, primal, stored, labels):
        ce, lse = fwd(h, stored, labels)
        return ce, (h, primal, stored, labels, lse)

    def loss_bwd(residuals, g):
        h, primal, stored, labels, lse = residuals
        dh, d_primal = bwd(h, primal, stored, labels, lse, g)
        return dh, None if frozen else d_primal, None, None

    loss.defvjp(loss_fwd, loss_bwd)
    return loss(h, w if primal is None else primal, w, labels)


def supports(sync: gs.Sync, vocab_dim: int) -> bool:
    """Chunks are cut along the vocabulary, which must not be split over replica axes."""
    return not sync.stored[vocab_dim] and not sync.grad[vocab_dim]

