"""The step's forward on one replica, composed once: embed -> blocks -> cross-entropy, and
the `ModelContext` it hands the model.

The dense gradient path (`jdist.step.grads`) runs the whole model as one chunk that is
both first and last; a pipeline stage (`jdist.step.pipelined`) runs its chunk of layers,
embedding only if its chunk is the first and adding the loss only if it is the last. Both
call `chunk`, so a change to the forward (prefetching, a new shared parameter) is made here
once.

A parameter tree reaches the forward as `Params`: the gradient-layout blocks that are
differentiated (`primal`), the stored blocks that are only read (`stored`), and how each
leaf is gathered and its gradient reduced (`sync`, `jdist.parallel.grad_sync`).

The `ModelContext` (`models.context`) carries what the step decides and the model only
calls: activation constraints from the rules, the attention kernel (`--attention`, or the
context-parallel one), expert dispatch, the sharded embedding lookup, per-layer parameter
handling and the remat wrapper. The loss is computed from the model's output head by the
vocabulary-parallel kernel (`token_losses`). All of it runs inside the step's `shard_map`,
whose manual axes the rules no longer mention (`inner_rules`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jdist.data import packing
from jdist.models import loss as objective
from jdist.models import remat
from jdist.models.context import ModelContext
from jdist.models.layers import weight
from jdist.models.mtp import next_targets
from jdist.models.names import BLOCKS, EMBED, HEAD, is_blocks
from jdist.models.precision import accumulator
from jdist.parallel import attention as attn
from jdist.parallel import collective_matmul, embedding, halves, prefetch
from jdist.parallel import grad_sync as gs
from jdist.parallel.attention.context import ContextParallel
from jdist.parallel.moe import expert_dispatch, expert_kernel, keeps_exchanges, overlap_pieces
from jdist.parallel.vocab import supports as vocab_supports
from jdist.parallel.vocab import vocab_parallel_cross_entropy
from jdist.quant import fp8
from jdist.spmd import axes as ax
from jdist.spmd.rules import (
    Rules,
    as_candidate,
    batch_split,
    constrainer,
    mesh_axes_of,
    resolve,
    without_axis,
)
from jdist.step import trainable

# --------------------------------------------------------------- the forward, composed once


class Params(NamedTuple):
    """A parameter (sub)tree on a replica: `primal` is differentiated (None for a frozen
    leaf), `stored` is read, `sync` says how each leaf is gathered and reduced."""

    primal: dict
    stored: dict
    sync: dict

    def shared(self) -> Params:
        """Everything but the stacked blocks: embedding, final norm, head."""
        return Params(*({k: v for k, v in t.items() if not is_blocks(k)} for t in self))

    def blocks(self) -> Params:
        """The stacked blocks only, by run (`models.runs`): {key: stack}."""
        return Params(*({k: v for k, v in t.items() if is_blocks(k)} for t in self))


@dataclasses.dataclass(frozen=True)
class Forward:
    """What the forward needs to know about the step: the plan, the manual axes of the
    shard_map it runs in, whether per-layer all-reduces are deferred (micro-batches
    accumulate), the sequence length, and the per-layer `Sync` of the blocks, by run
    ({run key: Sync tree}, `Params.blocks`)."""

    plan: object
    manual: tuple[str, ...]
    defer: bool
    seq_len: int
    block_sync: dict

    @functools.cached_property
    def cp(self) -> ContextParallel:
        return context_parallel_of(self.plan, self.manual)

    def in_kernel_order(self, tokens, targets):
        """(tokens, targets, segment ids or None, positions) in the context-parallel
        kernel's order: packed documents' layout (`jdist.data.packing`), or one text's."""
        segments, positions = packing.layout_of(self.plan.compute.eod_id, tokens)
        if segments is None:
            positions = self.cp.positions(tokens.shape[1])
        else:
            segments = reorder_tokens(self.cp, segments)
            positions = reorder_tokens(self.cp, positions)
        return (reorder_tokens(self.cp, tokens), reorder_tokens(self.cp, targets), segments,
                positions)

    def materialized(self, primal: dict, stored: dict, sync: dict) -> dict:
        """The values a layer computes with. A frozen leaf (None in `primal`) is gathered
        without a gradient; NF4-stored weights stay quantized until the layer uses them
        (`models.layers.weight`)."""
        dtype = self.plan.compute.dtype
        frozen = lambda s, y: jax.tree.map(lambda a, b: gs.gather(a, b, dtype), s, y)
        return jax.tree.map(lambda p, s, y: frozen(s, y) if p is None else
                            gs.materialize(p, s, y, dtype, self.defer), primal, stored, sync,
                            is_leaf=lambda x: x is None)

    def lookup(self, shared: Params):
        """The embedding lookup on the table's stored block, or None (gathered whole)."""
        return embed_lookup(self.plan, self.manual, shared.primal[EMBED],
                            shared.stored[EMBED], shared.sync[EMBED], self.defer)

    def head(self, shared: Params):
        """The output weight the chunked loss gathers chunk by chunk, or None."""
        return head_of(self.plan, shared.primal, shared.stored, shared.sync, self.defer)

    def shared_values(self, shared: Params) -> dict:
        """The shared parameters as the model reads them: gathered whole, except a table
        that is only looked up and a head the loss gathers itself (stored blocks)."""
        skip = unmaterialized(self.plan, self.lookup(shared), self.head(shared))
        return {k: shared.stored[k] if k in skip else
                self.materialized(shared.primal[k], shared.stored[k], shared.sync[k])
                for k in shared.stored}

    def context(self, shared: Params, blocks_primal):
        """The `ModelContext`: its layer loop materializes each layer's parameters from
        the stored blocks and differentiates `blocks_primal` (`layer_loop`)."""
        return model_context(self.plan, self.manual, self.seq_len,
                             partial(self.layer_loop, blocks_primal), self.lookup(shared))

    def layer_loop(self, primal: dict, layer, x, layers, rows: dict, run: str = BLOCKS):
        """`ModelContext.layer_loop`: prefetching (`prefetch.applies`), layer i+1's are
        gathered while layer i computes (`jdist.parallel.prefetch`); else each is gathered
        when its iteration starts. Both checkpoint the layer under `plan.compute.remat`, which
        `--tp-halves` runs on two halves of the rows (`jdist.parallel.halves`). `primal`
        holds every run's blocks; the loop runs the one stored under `run`."""
        primal, sync = primal[run], self.block_sync[run]
        stored = nnx.to_pure_dict(layers)
        checkpointed = remat.wrapper(self.plan.compute.remat, keeps_exchanges(
            self.plan.compute.remat, self.plan.model, dict(self.plan.mesh.shape)))
        if self.plan.compute.tp_halves:
            # x's rows are this replica's (the step is manual over the batch's axes).
            halves.check(x.shape[0], self.plan.model.n_experts)
            layer = halves.split(layer, rows)
        else:
            layer = partial(layer, rows=rows)
        n = jax.tree.leaves(stored)[0].shape[0]
        stream = self.plan.streams
        if prefetch.applies(self.plan.compute.prefetch, self.plan.mesh,
                            jax.tree.leaves(sync), n, stream):
            return prefetch.run(layer, x, stored, primal, sync,
                                dtype=self.plan.compute.dtype, defer=self.defer,
                                remat=checkpointed, stream=stream,
                                grads_home=self.plan.grads_stream)

        def one(x, scanned):
            layer_stored, layer_primal = scanned
            return layer(x, self.materialized(layer_primal, layer_stored, sync))
        return jax.lax.scan(checkpointed(one), x, (stored, primal))

    def cross_entropy(self, model, shared: Params, y, targets, ctx, scale):
        """This piece's `jdist.models.loss.piece_cross_entropy` of the last block's output."""
        losses = token_losses(self.plan, self.manual, model, y, targets, ctx,
                              self.head(shared))
        return objective.piece_cross_entropy(losses, targets, scale)

    def mtp_cross_entropy(self, model, shared: Params, y, tokens, targets, positions,
                          segments, ctx, scale):
        """The multi-token prediction's cross-entropy (`jdist.models.mtp`), over the token
        after next, on the main loss's scale: normalised by the count of the main targets,
        so that it is the same on every mesh and micro-batching."""
        h = model.predict_after_next(y, tokens, ctx, positions, segments)
        labels = next_targets(targets, segments)
        losses = token_losses(self.plan, self.manual, model, h, labels, ctx, self.head(shared),
                              norm=model.mtp.norm)
        return objective.piece_cross_entropy(losses, labels, scale)

    def terms(self, ce, stats, first_layer=0, mtp=None):
        """`jdist.models.loss.loss_terms` of a chunk: its cross-entropy (zero unless last), its
        MTP loss, and the MoE balance statistics of the layers it ran (from `first_layer`)."""
        cfg = self.plan.model
        if not cfg.n_experts or not stats:  # no experts, or none in this chunk
            return objective.loss_terms(cfg, ce, mtp=mtp)
        # A pipeline's `stage` is manual too, but not a replica axis.
        replicas = tuple(a for a in self.manual
                         if a in ax.REPLICA_AXES and self.plan.mesh.shape[a] > 1)
        share = stats["tokens"].shape[0] / cfg.moe_layers
        return objective.loss_terms(cfg, ce, stats, replicas, share, first_layer, mtp)


def chunk(fw: Forward, shared: Params, blocks: Params, x_in, tokens, targets, positions,
          segments, scale, first=True, last=True, first_layer=0):
    """One chunk of the model on one replica -> (output activation, loss terms). `first`
    embeds `tokens` (else `x_in` enters), `last` adds the cross-entropy. Python bools (the
    dense step: one chunk, first and last) run in line; traced ones (a pipeline tick) under
    `lax.cond`, so only the stages that embed or score gather the shared parameters.
    `first_layer`: the chunk's first layer in the stored stack (its loads' rows)."""
    ctx = fw.context(shared, blocks.primal)
    model = lambda shared_now: nnx.merge(fw.plan.graphdef, {**shared_now, **blocks.stored})
    static = isinstance(first, bool) and isinstance(last, bool)
    # In one trace the embedding and the loss share one gather (and one reduction) of the
    # shared parameters; each lax.cond branch is its own trace and gathers its own.
    values = functools.cache(lambda: fw.shared_values(shared)) if static else \
        (lambda: fw.shared_values(shared))
    x = _when(first, lambda: model(values()).embed_tokens(tokens, ctx), lambda: x_in)
    y, stats = model(shared.stored).run_blocks(x, ctx, positions, segments)
    zero = lambda: jnp.zeros((), accumulator(y))
    ce = _when(last, lambda: fw.cross_entropy(model(values()), shared, y, targets, ctx, scale),
               zero)
    mtp = None if not fw.plan.model.mtp_depth else _when(
        last, lambda: fw.mtp_cross_entropy(model(values()), shared, y, tokens, targets,
                                           positions, segments, ctx, scale), zero)
    return y, fw.terms(ce, stats, first_layer, mtp)


def _when(flag, then, otherwise):
    if isinstance(flag, bool):
        return then() if flag else otherwise()
    return jax.lax.cond(flag, then, otherwise)

# ------------------------------------------------- what the step hands the model


def inner_rules(rules: Rules, manual: tuple[str, ...]) -> Rules:
    """The rules for code that runs per slice of the `manual` axes (already spent)."""
    for a in manual:
        rules = without_axis(rules, a)
    return rules


def context_parallel_of(plan, manual: tuple[str, ...]) -> ContextParallel:
    return ContextParallel(plan.mesh, inner_rules(plan.rules, manual), plan.compute.cp_strategy)


def reorder_tokens(cp: ContextParallel, x):
    """Token ids [batch, length] in the context-parallel kernel's order. Taken whole first:
    inside the step's shard_map, with two automatic axes of size > 1 (sequence and tensor),
    XLA's SPMD partitioner (jax 0.10.2) aborts on the reorder's gather split along one
    (CHECK in ExpandDeviceGroupsWithIota); ids are tiny, so gathering them costs nothing."""
    if not cp.balanced:
        return x
    return cp.reorder(jax.lax.with_sharding_constraint(x, PartitionSpec()))


def attention_of(plan, seq_len: int) -> str:
    """The attention implementation the step runs (`--attention`, `auto` resolved)."""
    cp = ContextParallel(plan.mesh, plan.rules, plan.compute.cp_strategy)
    backend, capability = attn.accelerator(plan.mesh.devices.flat[0])
    return attn.choose(plan.compute.attention, backend=backend, capability=capability,
                       dtype=plan.compute.dtype, head_dim=plan.model.dim_per_head,
                       seq_len=seq_len, context_parallel=cp.size > 1,
                       heads_match=cp.q_spec[:3] == cp.kv_spec[:3],
                       sinks=plan.model.attention_sinks)


def model_context(plan, manual: tuple[str, ...], seq_len: int,
                  layer_loop: Callable | None = None,
                  embed_lookup: Callable | None = None) -> ModelContext:
    rules = inner_rules(plan.rules, manual)
    cp = ContextParallel(plan.mesh, rules, plan.compute.cp_strategy)
    extra = {} if layer_loop is None else {"layer_loop": layer_loop}
    if plan.compute.fp8 != "off":  # amaxes combined over the manual axes the batch is split over
        batch = batch_split(plan.mesh.shape, plan.rules)[0]
        extra |= fp8.hooks(plan.compute.fp8, tuple(a for a in manual if a in batch))
    elif collective_matmul.applies(plan.compute.collective_matmul, plan.mesh, rules,
                                   plan.pipeline is not None):
        extra |= collective_matmul.hooks(plan.mesh, rules)
    name = attention_of(plan, seq_len)
    return ModelContext(
        constrain=constrainer(plan.mesh, rules),
        attention=cp.attention if cp.size > 1 else attn.kernel(
            name, mesh=plan.mesh, q_spec=cp.q_spec, kv_spec=cp.kv_spec),
        moe=expert_dispatch(plan.mesh, rules, plan.compute.fp8,
                            overlap_pieces(plan.compute.moe_overlap, plan.mesh),
                            expert_kernel(plan.compute.expert_matmul, plan.mesh))
        if plan.model.n_experts else None,
        embed_lookup=embed_lookup, compute_dtype=plan.compute.dtype, **extra)


def token_losses(plan, manual: tuple[str, ...], model, x, labels, ctx: ModelContext,
                 head: tuple | None = None, norm=None):
    """Per-token cross-entropy [batch, length] of the residual stream `x` after the last
    block: from vocab chunks on each device's vocab shard (`--loss chunked`), or from the
    full logits (`--loss full`, the reference). `head`: (gradient-layout block, stored
    block, Sync, defer) of the output weight, gathered chunk by chunk inside the loss
    (`head_of`); None: the model's weight as it is. `norm`: the final norm, if not the
    model's (`Llama.output_head`)."""
    if plan.compute.loss == objective.FULL_LOGITS:
        return objective.cross_entropy(model.logits(x, ctx, norm), labels)
    rules = inner_rules(plan.rules, manual)
    h, param, vocab_dim = model.output_head(x, norm)
    w_names = (ax.EMBED, ax.VOCAB) if vocab_dim == 1 else (ax.VOCAB, ax.EMBED)
    w_spec = list(resolve(w_names, rules, plan.mesh)) + [None] * 2
    w_spec[1 - vocab_dim] = None  # the embed dim whole: each device dots full rows
    vocab_axes = set(mesh_axes_of(w_spec[vocab_dim]))
    tokens = resolve((ax.BATCH, ax.LENGTH), rules, plan.mesh)
    # Tokens replicated over the vocab axes (each device scores them on its shard).
    label_spec = PartitionSpec(*(as_candidate(a for a in mesh_axes_of(e) if a not in vocab_axes)
                                 for e in tokens))
    primal, stored, sync, defer = head if head else (None, weight(param, h), None, False)
    return vocab_parallel_cross_entropy(
        h, stored, labels, vocab_dim=vocab_dim, mesh=plan.mesh,
        h_spec=PartitionSpec(*label_spec, None), w_spec=PartitionSpec(*w_spec[:2]),
        label_spec=label_spec, sync=sync, primal=primal, defer=defer,
        frozen=trainable.frozen_base(plan.model))


def head_key(plan) -> str:
    """The parameter the output head multiplies by: the head, or the tied table."""
    return EMBED if plan.model.tie_embeddings else HEAD


def head_of(plan, primal: dict, stored: dict, sync: dict, defer: bool) -> tuple | None:
    """`token_losses`' `head` for the chunked loss, where the weight's layout allows it
    (vocabulary not split over replica axes); None: the step gathers it whole. A frozen
    weight's primal is None: the loss computes no gradient for it."""
    key = head_key(plan)
    vocab_dim = 0 if plan.model.tie_embeddings else 1
    # (Tied, this is the condition of the table's lookup too: both read the stored block.)
    if plan.compute.loss != objective.CHUNKED or not vocab_supports(sync[key], vocab_dim):
        return None
    return primal[key], stored[key], sync[key], defer


def embed_lookup(plan, manual: tuple[str, ...], primal, stored, sync, defer: bool):
    """`ModelContext.embed_lookup` on the table's stored block (`jdist.parallel.embedding`),
    or None where its layout needs the plain gather."""
    if not embedding.supports(sync):
        return None
    vocab = resolve((ax.VOCAB, ax.EMBED), inner_rules(plan.rules, manual), plan.mesh)[0]
    # A frozen table (primal None) is never differentiated: its stored block stands in.
    return partial(embedding.lookup, stored if primal is None else primal, stored, sync=sync,
                   dtype=plan.compute.dtype, defer=defer, mesh=plan.mesh,
                   vocab_axes=mesh_axes_of(vocab))


def unmaterialized(plan, lookup, head) -> set[str]:
    """Shared parameters the step does not gather whole: an untied table that is only looked
    up (`embed_lookup`), an output weight the loss gathers chunk by chunk (`head_of`)."""
    tied = plan.model.tie_embeddings
    skip = {head_key(plan)} if head else set()
    return skip | ({EMBED} if lookup and not tied else set())
