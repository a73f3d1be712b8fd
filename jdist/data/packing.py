"""Packed documents: several documents share one training sequence, separated by the
tokenizer's end-of-document id, and never see each other.

With `--packing documents` the step derives, from the input tokens alone, each token's
segment (document) id and its position inside its document. The end-of-document token
opens the next document (it acts as that document's beginning-of-sequence token), so
every prediction is made from its own document's context only: a document's last token
predicts the end-of-document id, which then predicts the next document's first token.
Attention masks keys of other segments in every implementation (`models.layers`,
`jdist.parallel.attention.blockwise` and the kernels built on it, cuDNN), and rotary positions
restart at 0 on each end-of-document token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NONE, DOCUMENTS = "none", "documents"
PACKINGS = (NONE, DOCUMENTS)


def document_layout(tokens: jax.Array, eod_id: int) -> tuple[jax.Array, jax.Array]:
    """(segment ids, positions), int32 [batch, length], of token ids [batch, length]: the
    segment counts the end-of-document tokens up to and including this one; the position
    is the distance to the segment's first token (its end-of-document token, or the row's
    start)."""
    boundary = tokens == eod_id
    segment_ids = jnp.cumsum(boundary, axis=1, dtype=jnp.int32)
    index = jax.lax.broadcasted_iota(jnp.int32, tokens.shape, 1)
    starts = jax.lax.cummax(jnp.where(boundary, index, 0), axis=1)
    return segment_ids, index - starts


def layout_of(eod_id: int | None, tokens: jax.Array):
    """`document_layout` when packing (`eod_id` given), else (None, None): one text."""
    if eod_id is None:
        return None, None
    return document_layout(tokens, eod_id)
