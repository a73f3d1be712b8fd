"""The collectives jdist's own code writes, derived from it: `jdist.parallel.grad_sync`'s
per-layer parameter gathers and gradient reductions, the embedding lookup
(`jdist.parallel.embedding`), the chunked loss (`jdist.parallel.vocab`), the loss's
psums (`jdist.models.loss`, `jdist.step.grads`), and the pipeline's permutes and stage sums
(`jdist.parallel.pipeline.program`, `jdist.step.pipelined`). The context-parallel and MoE
kernels' are in `kernels.py`.

Where automatic axes also split an operand, the partitioner changes what a collective
moves: those pieces come from `partitioner.py` (fitted, not derived).
"""

from __future__ import annotations

import dataclasses

from jdist.models import loss as objective
from jdist.models.names import EMBED, FINAL_NORM
from jdist.models.runs import runs
from jdist.parallel.vocab import chunk_size
from jdist.plan.traffic import partitioner
from jdist.plan.traffic.layout import (
    A2A,
    AG,
    AR,
    F32,
    PERMUTE,
    PIPE_MANUAL,
    RS,
    S32,
    Collective,
    Leaf,
    Step,
    embed_split,
    lookup_supported,
    mesh_axes,
    vocab_axes,
)
from jdist.spmd import axes as ax
from jdist.spmd.rules import mesh_axes_of, resolve
from jdist.step.forward import inner_rules
from jdist.step.grads import MANUAL

# ---------------------------------------------------------------------------------------
# Parameters: gathered just in time, gradients reduced as produced (grad_sync)


def gather(st: Step, leaf: Leaf, source: str = "grad_sync.gather") -> list[Collective]:
    """`grad_sync.gather`: the stored block all-gathered over the replica axes it is split
    on, dimension by dimension, in the compute dtype (matrices) or float32 (norm scales),
    on each device's block of the automatic axes (`grad_sync.on_shards`)."""
    if not leaf.sync.gathers:
        return []
    dtype = st.dtype if leaf.matrix else leaf.dtype
    return gathers_by_dim(st, leaf.sync.stored, leaf.local, 1, dtype, source)


def gathers_by_dim(st: Step, groups: tuple[tuple[str, ...], ...], full: int, count: int,
                   dtype: str, source: str) -> list[Collective]:
    """All-gathers of an array of `full` elements stored split over `groups` (one tuple of
    axes per dimension), dimension by dimension, each gathering the shard grown so far."""
    out, left = [], st.ways(groups)
    for axes in groups:
        if axes:
            left //= st.size(axes)
            out.append(Collective(AG, mesh_axes(axes, st.plan.mesh), count, full // left,
                                  dtype, source))
    return out


def reduce(st: Step, leaf: Leaf, defer: bool, source: str = "grad_sync.reduce",
           elements: int | None = None) -> list[Collective]:
    """`grad_sync.reduce` of one full float32 cotangent (`elements` per device, default the
    leaf's, on its block of the automatic axes): an all-reduce over the replica axes its
    gradient is not split on (postponed to `finish` under `defer`), then a reduce-scatter
    per dimension it is split on."""
    if not leaf.trained:
        return []
    full = leaf.local if elements is None else elements
    mesh = st.plan.mesh
    out = []
    if leaf.sync.reduce and not defer:
        out.append(Collective(AR, mesh_axes(leaf.sync.reduce, mesh), 1, full, F32, source))
    for axes in leaf.sync.grad:
        if axes:
            full //= st.size(axes)
            out.append(Collective(RS, mesh_axes(axes, mesh), 1, full, F32, source))
    return out


def finish(st: Step, leaf: Leaf, layers: int) -> list[Collective]:
    """`grad_sync.finish_reduce`: the all-reduce `defer` postponed, once per step, of the
    accumulated gradient as laid out (a block leaf's stack of `layers`)."""
    if not (leaf.trained and leaf.sync.reduce):
        return []
    return [Collective(AR, mesh_axes(leaf.sync.reduce, st.plan.mesh), 1,
                       layers * leaf.local // st.ways(leaf.sync.grad) // leaf.stages, F32,
                       "grad_sync.finish_reduce")]


def finish_all(st: Step, stages: int = 1) -> list[Collective]:
    """`finish` of every leaf, each run's stack of blocks of its layers (a pipeline stage's
    share of them: 1 / `stages`)."""
    layers = {r.key: r.rows // stages for r in runs(st.model)}  # a periodic run's periods
    return [c for leaf in st.leaves for c in finish(st, leaf, layers.get(leaf.key, 1))]


# ---------------------------------------------------------------------------------------
# Outside the layers, per micro-batch: embedding, loss


def embedding_forward(st: Step) -> list[Collective]:
    """jdist.parallel.embedding forward: token ids all-gathered over the replica axes G
    splitting the table's embed dimension, each vocab shard's rows summed over tensor
    (float32, before the cast), an all-to-all of the rows back to their replica."""
    if not lookup_supported(st):  # the table gathered whole, as any parameter
        return gather(st, st.leaf(EMBED), "grad_sync.gather (embedding)")
    split = embed_split(st)
    # The replica's rows, all of them on every device of an automatic batch axis (expert).
    tokens, d = st.rows * st.size(st.bt) * st.seq, st.model.d_model
    vocab = vocab_axes(st, st.leaf(EMBED), 0)
    out = []
    if split:
        out.append(Collective(AG, split, 1, tokens * st.size(split), S32, "embedding: ids"))
    if vocab:
        out.append(Collective(AR, vocab, 1, tokens * d, F32, "embedding: rows over vocab"))
    if split:
        out.append(Collective(A2A, split, 1, tokens * d, st.dtype, "embedding: rows"))
    return out


def embedding_backward(st: Step, defer: bool) -> list[Collective]:
    """jdist.parallel.embedding backward: the all-to-all reversed in float32, then the
    table block's gradient (already summed over G) reduced like any parameter's."""
    leaf = st.leaf(EMBED)
    if not lookup_supported(st):
        return reduce(st, leaf, defer, "grad_sync.reduce (embedding)")
    split = embed_split(st)
    out = []
    if split and leaf.trained:  # a frozen table's rows need no gradient
        out.append(Collective(A2A, split, 1, st.rows * st.size(st.bt) * st.seq * st.model.d_model,
                              F32, "embedding: row gradients"))
    further = tuple(g[len(s):] for s, g in zip(leaf.sync.stored, leaf.sync.grad))
    table = dataclasses.replace(leaf, sync=dataclasses.replace(leaf.sync, grad=further))
    return out + reduce(st, table, defer, "embedding: table gradient",
                        leaf.local // st.size(split))


@dataclasses.dataclass(frozen=True)
class LossShape:
    """How jdist.step.forward.token_losses runs vocab_parallel_cross_entropy."""

    leaf: Leaf               # the head, or the tied table
    vocab: tuple[str, ...]   # axes the vocabulary is split over in the kernel
    tokens: tuple[str, ...]  # axes the tokens are split over in the kernel
    chunk: int               # vocabulary rows per chunk (vocab.chunk_size)
    n_chunks: int
    local_tokens: int        # tokens per device per micro-batch in the kernel


def loss_shape(st: Step) -> LossShape | None:
    """The chunked loss's layout; None where the step gathers the head whole instead
    (`--loss full`, or a vocabulary split over replica axes: context.head_of)."""
    leaf, vocab_dim = st.head, 0 if st.model.tie_embeddings else 1
    if st.plan.compute.loss != objective.CHUNKED or leaf.sync.stored[vocab_dim] \
            or leaf.sync.grad[vocab_dim]:
        return None
    vocab = vocab_axes(st, leaf, vocab_dim)
    manual = PIPE_MANUAL if st.plan.pipeline is not None else MANUAL
    spec = resolve((ax.BATCH, ax.LENGTH), inner_rules(st.plan.rules, manual), st.plan.mesh)
    tokens = mesh_axes((a for e in spec for a in mesh_axes_of(e) if a not in vocab),
                       st.plan.mesh)
    batch_axes = [a for a in tokens if a in mesh_axes_of(spec[0])]
    local_tokens = st.rows * st.size(batch_axes) * st.seq // st.size(tokens)
    local_vocab = st.model.vocab_size // st.size(vocab)
    chunk = chunk_size(local_tokens, local_vocab)
    return LossShape(leaf, vocab, tokens, chunk, -(-local_vocab // chunk), local_tokens)


def head_gathers(st: Step, shape: LossShape) -> list[Collective]:
    """vocab._weight_chunk, for every chunk: its rows of the head all-gathered over the
    replica axes splitting the embed dimension, in the compute dtype. (Inside the kernel,
    manual over the vocab axes too: no tensor gather first.) A chunk loop prefetches one
    chunk past its last (`vocab._over_chunks`)."""
    return gathers_by_dim(st, shape.leaf.sync.stored, shape.chunk * st.model.d_model,
                          shape.n_chunks + (shape.n_chunks > 1), st.dtype,
                          "vocab: head chunks")


def loss_forward(st: Step, shape: LossShape, picked: bool = True) -> list[Collective]:
    """vocab._forward: each token's max, sum-exp and label logit reduced over the vocab
    axes (float32). A recompute that needs only the log-sum-exp drops the label logit's
    (`picked` False)."""
    if not shape.vocab:
        return []
    return [Collective(AR, shape.vocab, 3 if picked else 2, shape.local_tokens, F32,
                       "vocab: max, sum-exp, label logit")]


def loss_backward(st: Step, shape: LossShape, defer: bool) -> list[Collective]:
    """vocab._backward: each chunk's dW summed over the token axes, then reduced as
    grad_sync reduces every parameter; the hidden states' gradient summed over vocab."""
    d = st.model.d_model
    per_chunk = []
    if shape.tokens and shape.leaf.trained:
        per_chunk.append(Collective(AR, shape.tokens, 1, shape.chunk * d, F32,
                                    "vocab: head chunk gradient over token axes"))
    per_chunk += reduce(st, shape.leaf, defer, "vocab: head chunk gradient",
                        shape.chunk * d)
    out = [c.times(shape.n_chunks) for c in per_chunk]
    if shape.vocab:
        out.append(Collective(AR, shape.vocab, 1, shape.local_tokens * d, F32,
                              "vocab: hidden-state gradient"))
    return out


def final_norm_grad(st: Step, defer: bool) -> list[Collective]:
    """The final norm scale's gradient: partial sums over token axes (partitioner), then
    grad_sync's."""
    leaf = st.leaf(FINAL_NORM)
    return partitioner.token_partials(st, leaf) + \
        reduce(st, leaf, defer, "grad_sync.reduce (final norm)")


def balance_totals(st: Step) -> list[Collective]:
    """jdist.models.loss.loss_terms: an MoE model's balance statistics of every layer summed over
    the replica axes, per micro-batch."""
    m = st.model
    replicas = mesh_axes(MANUAL, st.plan.mesh)
    if not (m.n_experts and replicas):
        return []
    return [Collective(AR, replicas, 1, m.moe_layers * (2 * m.n_experts + 3), F32,
                       "loss: balance statistics over replicas")]


# ---------------------------------------------------------------------------------------
# Once per step


def loss_scalars(st: Step, manual: tuple[str, ...]) -> list[Collective]:
    """The counted targets (int32) summed over the replica axes, and the loss terms over
    the step's manual axes (`jdist.step.grads`, `jdist.step.pipelined`)."""
    mesh = st.plan.mesh
    return [Collective(AR, mesh_axes(MANUAL, mesh), 1, 1, S32, "loss: token count"),
            Collective(AR, mesh_axes(manual, mesh), 1, objective.term_count(st.model), F32,
                       "loss: terms")]


def stage_permutes(st: Step, ticks: int) -> list[Collective]:
    """stage_program: after every tick the output activation goes to the next stage and
    the input cotangent to the previous one (compute dtype), idle ticks included."""
    return [Collective(PERMUTE, (ax.STAGE,), 2 * ticks, st.act // st.size(st.sp), st.dtype,
                       "stage_program: activations, cotangents")]


def stage_sums(st: Step) -> list[Collective]:
    """pipelined._run: the shared parameters split over stage gathered whole before the
    ticks and their gradients reduce-scattered back after them; the others' gradients
    summed over stage (`jdist.parallel.pipeline.shared`)."""
    out = []
    for leaf in st.shared():
        grad = leaf.local // st.ways(leaf.sync.grad)
        if leaf.stages > 1:
            out.append(Collective(AG, (ax.STAGE,), 1, leaf.stored * leaf.stages, leaf.dtype,
                                  "pipelined: shared parameters over stage"))
        if leaf.trained:
            out.append(Collective(RS if leaf.stages > 1 else AR, (ax.STAGE,), 1,
                                  grad // leaf.stages, F32,
                                  "pipelined: shared gradients over stage"))
    return out
