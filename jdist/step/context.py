"""The `ModelContext` a training step hands the model: activation constraints from the
rules, the attention kernel (`--attention`, or the context-parallel one), expert
dispatch, per-layer parameter handling and the remat wrapper; and the step's loss from
the model's output head. All for code running inside the step's `shard_map` (whose manual
axes the rules no longer mention)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jdist import axes as ax
from jdist import loss as objective
from jdist import remat
from jdist.parallel import attention as attn
from jdist.parallel import embedding
from jdist.parallel.context import ContextParallel
from jdist.parallel.moe import expert_dispatch
from jdist.parallel.vocab import supports as vocab_supports
from jdist.parallel.vocab import vocab_parallel_cross_entropy
from jdist.rules import Rules, as_candidate, constrainer, mesh_axes_of, resolve, without_axis
from jdist.step import trainable
from models.context import ModelContext
from models.layers import weight
from models.names import EMBED, HEAD


def inner_rules(rules: Rules, manual: tuple[str, ...]) -> Rules:
    """The rules for code that runs per slice of the `manual` axes (already spent)."""
    for a in manual:
        rules = without_axis(rules, a)
    return rules


def context_parallel_of(plan, manual: tuple[str, ...]) -> ContextParallel:
    return ContextParallel(plan.mesh, inner_rules(plan.rules, manual), plan.cp_strategy)


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
    cp = ContextParallel(plan.mesh, plan.rules, plan.cp_strategy)
    backend, capability = attn.accelerator(plan.mesh.devices.flat[0])
    return attn.choose(plan.attention, backend=backend, capability=capability,
                       dtype=plan.compute_dtype, head_dim=plan.model.dim_per_head,
                       seq_len=seq_len, context_parallel=cp.size > 1,
                       heads_match=cp.q_spec[:3] == cp.kv_spec[:3])


def model_context(plan, manual: tuple[str, ...], seq_len: int,
                  layer_params: Callable | None = None, layer_stream: Any = None,
                  embed_lookup: Callable | None = None) -> ModelContext:
    rules = inner_rules(plan.rules, manual)
    cp = ContextParallel(plan.mesh, rules, plan.cp_strategy)
    extra = {} if layer_params is None else {"layer_params": layer_params,
                                             "layer_stream": layer_stream}
    name = attention_of(plan, seq_len)
    return ModelContext(
        constrain=constrainer(plan.mesh, rules),
        attention=cp.attention if cp.size > 1 else attn.kernel(
            name, mesh=plan.mesh, q_spec=cp.q_spec, kv_spec=cp.kv_spec),
        moe=expert_dispatch(plan.mesh, rules) if plan.model.n_experts else None,
        remat_layer=remat.wrapper(plan.remat),
        embed_lookup=embed_lookup, compute_dtype=plan.compute_dtype, **extra)


def token_losses(plan, manual: tuple[str, ...], model, x, labels, ctx: ModelContext,
                 head: tuple | None = None):
    """Per-token cross-entropy [batch, length] of the residual stream `x` after the last
    block: from vocab chunks on each device's vocab shard (`--loss chunked`), or from the
    full logits (`--loss full`, the reference). `head`: (gradient-layout block, stored
    block, Sync, defer) of the output weight, gathered chunk by chunk inside the loss
    (`head_of`); None: the model's weight as it is."""
    if plan.loss == objective.FULL_LOGITS:
        return objective.cross_entropy(model.logits(x, ctx), labels)
    rules = inner_rules(plan.rules, manual)
    h, param, vocab_dim = model.output_head(x)
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
    if plan.loss != objective.CHUNKED or not vocab_supports(sync[key], vocab_dim):
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
                   dtype=plan.compute_dtype, defer=defer, mesh=plan.mesh,
                   vocab_axes=mesh_axes_of(vocab))


def unmaterialized(plan, lookup, head) -> set[str]:
    """Shared parameters the step does not gather whole: an untied table that is only looked
    up (`embed_lookup`), an output weight the loss gathers chunk by chunk (`head_of`)."""
    tied = plan.model.tie_embeddings
    skip = {head_key(plan)} if head else set()
    return skip | ({EMBED} if lookup and not tied else set())
