"""The step's forward on one replica, composed once: embed -> blocks -> cross-entropy.

The dense gradient path (`jdist.step.grads`) runs the whole model as one chunk that is
both first and last; a pipeline stage (`jdist.step.pipelined`) runs its chunk of layers,
embedding only if its chunk is the first and adding the loss only if it is the last. Both
call `chunk`, so a change to the forward (prefetching, a new shared parameter) is made here
once.

A parameter tree reaches the forward as `Params`: the gradient-layout blocks that are
differentiated (`primal`), the stored blocks that are only read (`stored`), and how each
leaf is gathered and its gradient reduced (`sync`, `jdist.parallel.grad_sync`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jdist import axes as ax
from jdist import loss as objective
from jdist import packing
from jdist.parallel import grad_sync as gs
from jdist.parallel.context import ContextParallel
from jdist.step.context import (
    context_parallel_of,
    embed_lookup,
    head_of,
    model_context,
    reorder_tokens,
    token_losses,
    unmaterialized,
)
from models.names import BLOCKS, EMBED


class Params(NamedTuple):
    """A parameter (sub)tree on a replica: `primal` is differentiated (None for a frozen
    leaf), `stored` is read, `sync` says how each leaf is gathered and reduced."""

    primal: dict
    stored: dict
    sync: dict

    def shared(self) -> Params:
        """Everything but the stacked blocks: embedding, final norm, head."""
        return Params(*({k: v for k, v in t.items() if k != BLOCKS} for t in self))


@dataclasses.dataclass(frozen=True)
class Forward:
    """What the forward needs to know about the step: the plan, the manual axes of the
    shard_map it runs in, whether per-layer all-reduces are deferred (micro-batches
    accumulate), the sequence length, and the per-layer `Sync` of the blocks."""

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
        kernel's order: packed documents' layout (`jdist.packing`), or one text's."""
        segments, positions = packing.layout_of(self.plan.eod_id, tokens)
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
        dtype = self.plan.compute_dtype
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
        """The `ModelContext`: each layer's parameters materialized inside the layer loop
        from its slice of `blocks_primal`."""
        def layer_params(layer_state, layer_primal):
            return self.materialized(layer_primal, nnx.to_pure_dict(layer_state),
                                     self.block_sync)

        return model_context(self.plan, self.manual, self.seq_len, layer_params,
                             blocks_primal, self.lookup(shared))

    def cross_entropy(self, model, shared: Params, y, targets, ctx, scale):
        """This piece's `jdist.loss.piece_cross_entropy` of the last block's output."""
        losses = token_losses(self.plan, self.manual, model, y, targets, ctx,
                              self.head(shared))
        return objective.piece_cross_entropy(losses, targets, scale)

    def terms(self, ce, stats):
        """`jdist.loss.loss_terms` of a chunk: its cross-entropy (zero unless last) and the
        MoE balance statistics of the layers it ran."""
        cfg = self.plan.model
        if not cfg.n_experts:
            return objective.loss_terms(cfg, ce)
        # A pipeline's `stage` is manual too, but not a replica axis.
        replicas = tuple(a for a in self.manual
                         if a in ax.REPLICA_AXES and self.plan.mesh.shape[a] > 1)
        share = stats["tokens"].shape[0] / cfg.n_layers
        return objective.loss_terms(cfg, ce, stats, replicas, share)


def chunk(fw: Forward, shared: Params, blocks: Params, x_in, tokens, targets, positions,
          segments, scale, first=True, last=True):
    """One chunk of the model on one replica -> (output activation, loss terms). `first`
    embeds `tokens` (else `x_in` enters), `last` adds the cross-entropy. Python bools (the
    dense step: one chunk, first and last) run in line; traced ones (a pipeline tick) under
    `lax.cond`, so only the stages that embed or score gather the shared parameters."""
    ctx = fw.context(shared, blocks.primal)
    model = lambda shared_now: nnx.merge(fw.plan.graphdef, {**shared_now, BLOCKS: blocks.stored})
    static = isinstance(first, bool) and isinstance(last, bool)
    # In one trace the embedding and the loss share one gather (and one reduction) of the
    # shared parameters; each lax.cond branch is its own trace and gathers its own.
    values = functools.cache(lambda: fw.shared_values(shared)) if static else \
        (lambda: fw.shared_values(shared))
    x = _when(first, lambda: model(values()).embed_tokens(tokens, ctx), lambda: x_in)
    y, stats = model(shared.stored).run_blocks(x, ctx, positions, segments)
    ce = _when(last, lambda: fw.cross_entropy(model(values()), shared, y, targets, ctx, scale),
               lambda: jnp.zeros((), jnp.float32))
    return y, fw.terms(ce, stats)


def _when(flag, then, otherwise):
    if isinstance(flag, bool):
        return then() if flag else otherwise()
    return jax.lax.cond(flag, then, otherwise)
