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

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jdist.parallel import CHECK_VMA, kernel_mesh, varying, vma

# Bytes of one float32 [tokens, chunk] logits block: bounds the loss's temporaries (a few
# such blocks are live) whatever the vocabulary.
CHUNK_BYTES = 32 * 2**20


def chunk_size(n_tokens: int, vocab: int, budget: int = CHUNK_BYTES) -> int:
    """The largest divisor of `vocab` whose float32 [n_tokens, chunk] block fits `budget`."""
    limit = max(1, budget // (4 * max(n_tokens, 1)))
    return max(d for d in range(1, min(vocab, limit) + 1) if vocab % d == 0)


def _logits(h, w, start, size, vocab_dim):
    """float32 logits [b, s, size] of vocabulary rows start..start+size."""
    w_c = lax.dynamic_slice_in_dim(w, start, size, vocab_dim)
    eq = "bse,ev->bsv" if vocab_dim == 1 else "bse,ve->bsv"
    return jnp.einsum(eq, h, w_c, preferred_element_type=jnp.float32)


def _local_labels(labels, w, vocab_dim, axes):
    """Labels relative to this device's vocabulary slice (outside [0, local) if elsewhere)."""
    local = w.shape[vocab_dim]
    index = lax.axis_index(axes) if axes else 0
    return labels - index * local


def _forward(axes, chunk, vocab_dim, h, w, labels):
    """(per-token cross-entropy [b, s], log-sum-exp [b, s])."""
    b, s = labels.shape
    local = w.shape[vocab_dim]
    rel = _local_labels(labels, w, vocab_dim, axes)
    like = tuple({*vma(h), *vma(w), *vma(labels)})
    start = (varying(jnp.full((b, s), -jnp.inf, jnp.float32), like),
             varying(jnp.zeros((b, s), jnp.float32), like),
             varying(jnp.zeros((b, s), jnp.float32), like))

    def body(carry, i):
        m, norm, picked = carry
        logits = _logits(h, w, i * chunk, chunk, vocab_dim)
        new_m = jnp.maximum(m, logits.max(-1))
        norm = norm * jnp.exp(m - new_m) + jnp.exp(logits - new_m[..., None]).sum(-1)
        hit = (rel - i * chunk)[..., None] == lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        return (new_m, norm, picked + jnp.where(hit, logits, 0.0).sum(-1)), None

    (m, norm, picked), _ = _over_chunks(body, start, local // chunk)
    if axes:
        top = lax.pmax(m, axes)
        norm = lax.psum(norm * jnp.exp(m - top), axes)
        m, picked = top, lax.psum(picked, axes)
    lse = m + jnp.log(norm)
    return lse - picked, lse


def _backward(axes, token_axes, chunk, vocab_dim, h, w, labels, lse, g):
    local = w.shape[vocab_dim]
    # Tokens split over `token_axes` (sequence, expert) each give part of dW, summed below
    # in float32; without such a sum each chunk of dW is final and kept in w's dtype.
    dw_dtype = jnp.float32 if token_axes else w.dtype
    rel = _local_labels(labels, w, vocab_dim, axes)
    g = g.astype(jnp.float32)

    def body(carry, i):
        dh, dw = carry
        logits = _logits(h, w, i * chunk, chunk, vocab_dim)
        hit = (rel - i * chunk)[..., None] == lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        dlogits = ((jnp.exp(logits - lse[..., None]) - hit) * g[..., None]).astype(h.dtype)
        w_c = lax.dynamic_slice_in_dim(w, i * chunk, chunk, vocab_dim)
        eq_h = "bsv,ev->bse" if vocab_dim == 1 else "bsv,ve->bse"
        eq_w = "bse,bsv->ev" if vocab_dim == 1 else "bse,bsv->ve"
        dh = dh + jnp.einsum(eq_h, dlogits, w_c, preferred_element_type=jnp.float32)
        dw_c = jnp.einsum(eq_w, h, dlogits, preferred_element_type=jnp.float32)
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw_dtype), i * chunk, vocab_dim)
        return (dh, dw), None

    like = tuple({*vma(h), *vma(w), *vma(labels)})
    start = (varying(jnp.zeros(h.shape, jnp.float32), like),
             varying(jnp.zeros(w.shape, dw_dtype), like))
    (dh, dw), _ = _over_chunks(body, start, local // chunk)
    if axes:  # every vocab slice contributed to each token's hidden-state gradient
        dh = lax.psum(dh, axes)
    if token_axes:
        dw = lax.psum(dw, token_axes)
    return dh.astype(h.dtype), dw.astype(w.dtype)


def _over_chunks(body, start, n: int):
    """`lax.scan` of `body` over chunk indices 0..n-1; no loop for a single chunk."""
    return body(start, 0) if n == 1 else lax.scan(body, start, jnp.arange(n))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _loss(axes, token_axes, chunk, vocab_dim, h, w, labels):
    return _forward(axes, chunk, vocab_dim, h, w, labels)[0]


def _fwd(axes, token_axes, chunk, vocab_dim, h, w, labels):
    ce, lse = _forward(axes, chunk, vocab_dim, h, w, labels)
    return ce, (h, w, labels, lse)


def _bwd(axes, token_axes, chunk, vocab_dim, residuals, g):
    h, w, labels, lse = residuals
    dh, dw = _backward(axes, token_axes, chunk, vocab_dim, h, w, labels, lse, g)
    return dh, dw, None


_loss.defvjp(_fwd, _bwd)


def vocab_parallel_cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *,
                                 vocab_dim: int, mesh, h_spec, w_spec, label_spec,
                                 chunk_bytes: int = CHUNK_BYTES) -> jax.Array:
    """Per-token -log softmax(h @ w)[label], float32 [b, s], exact. h [b, s, embed] (its
    spec must not use the vocab axes), w [embed, vocab] (`vocab_dim` 1) or [vocab, embed]
    (0, a tied table), labels [b, s] global ids."""
    axes = tuple(a for a in _axes_of(w_spec, vocab_dim) if mesh.shape[a] > 1)
    token_axes = tuple(a for d in (0, 1) for a in _axes_of(label_spec, d) if mesh.shape[a] > 1)
    n = math.prod(mesh.shape[a] for a in axes)
    local_tokens = labels.size // math.prod(mesh.shape[a] for a in token_axes)
    chunk = chunk_size(local_tokens, w.shape[vocab_dim] // n, chunk_bytes)
    return jax.shard_map(partial(_loss, axes, token_axes, chunk, vocab_dim), **kernel_mesh(mesh),
                         in_specs=(h_spec, w_spec, label_spec), out_specs=label_spec,
                         check_vma=CHECK_VMA)(h, w, labels)


def _axes_of(spec, dim: int) -> tuple[str, ...]:
    entry = tuple(spec)[dim] if dim < len(spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
