"""The training objective, written once: next-token cross-entropy plus, for MoE models, the
weighted load-balancing losses; and the metric names it reports.

A step computes `loss_terms` for each piece of work it differentiates (one replica's
micro-batch; a pipeline chunk's share of one) and averages them; `report` turns the mean
terms into the reported loss and metrics. The objective is term 0 (what is differentiated);
the other terms are reported only. `Objective` is what a gradient path holds of all this:
the scale of its pieces, the length of the terms, and the one call every path ends in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jdist.models.precision import accumulator

OBJECTIVE, CROSS_ENTROPY = "loss", "ce_loss"  # metrics keys
AUX_LOSS, Z_LOSS = "moe_aux_loss", "moe_z_loss"
MTP_LOSS = "mtp_loss"  # multi-token prediction's cross-entropy (models.mtp)
DROPPED_FRACTION, LOAD_IMBALANCE = "moe_dropped_fraction", "moe_load_imbalance"
# --loss: cross-entropy over vocab chunks on each device's shard (jdist.parallel.vocab), or
# from [batch, length, vocab] logits (the reference).
CHUNKED, FULL_LOGITS = "chunked", "full"
LOSSES = (CHUNKED, FULL_LOGITS)
_DROPPED, _ASSIGNED = "dropped", "assigned"  # raw sums, not reported


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token -log softmax(logits)[label], in float32. The label's logit is picked with a
    select and a sum over vocab rather than a gather: the same value (the sum adds exact
    zeros) and the same one-hot gradient, and XLA's SPMD partitioner (jax 0.10) aborts on
    the gather inside a pipeline stage with two automatic axes of size > 1 (CHECK in
    ExpandDeviceGroupsWithIota)."""
    logits = logits.astype(accumulator(logits))
    hit = labels[..., None] == jax.lax.broadcasted_iota(labels.dtype, logits.shape,
                                                        logits.ndim - 1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.where(hit, logits, 0.0).sum(-1)


IGNORE = -1  # a target that is not counted (loss masks: prompt tokens, padding)


def counted(targets: jax.Array) -> jax.Array:
    """Which targets the loss counts: all but IGNORE (any negative id)."""
    return targets >= 0


def token_count(targets: jax.Array) -> jax.Array:
    return counted(targets).sum(dtype=jnp.int32)


def piece_cross_entropy(token_ce: jax.Array, targets: jax.Array, scale) -> jax.Array:
    """One piece's cross-entropy term from per-token values: the sum over its counted tokens
    times `scale` = pieces / (counted tokens of the whole global batch). A step averages its
    pieces (micro-batches x replicas), so the loss is the global sum over the global count,
    never a mean of per-piece means: the same for every mesh and micro-batching even when
    pieces count different numbers of tokens."""
    return jnp.where(counted(targets), token_ce, 0.0).sum() * scale


def piece_scale(pieces: int, global_count: jax.Array) -> jax.Array:
    """`piece_cross_entropy`'s scale (a batch with nothing counted has loss 0)."""
    return pieces / jnp.maximum(global_count, 1).astype(jnp.float32)


def term_names(model) -> tuple[str, ...]:
    """The named terms `loss_terms` starts with: the objective; with multi-token prediction
    or experts, the cross-entropy, the MTP loss, the balancing losses the step reports, then
    the raw sums `report` turns into the dropped fraction."""
    mtp = (MTP_LOSS,) if model.mtp_depth else ()
    if not model.n_experts:
        return (OBJECTIVE, CROSS_ENTROPY, *mtp) if mtp else (OBJECTIVE,)  # else: the CE itself
    return (OBJECTIVE, CROSS_ENTROPY, *mtp, AUX_LOSS, Z_LOSS, _DROPPED, _ASSIGNED)


def term_count(model) -> int:
    """The length of `loss_terms`: its named terms, then for MoE models the assignments per
    expert of every layer [layers, E] (`report`'s load imbalance; `layer_loads`)."""
    return len(term_names(model)) + model.moe_layers * model.n_experts


def layer_loads(model, mean_terms: jax.Array, micro: int) -> jax.Array | None:
    """The assignments per expert of every layer [layers, E] (stored layer order) over the
    whole batch, from `loss_terms` averaged over the step's `micro` micro-batches (each
    piece's loads already count every replica's tokens), rounded back to the integer
    counts they are; None without routing biases."""
    if not model.router_bias_rate:
        return None
    return jnp.round(_loads(model, mean_terms) * micro)


def _loads(model, terms: jax.Array) -> jax.Array:
    return terms[len(term_names(model)):].reshape(model.moe_layers, model.n_experts)


def balance_losses(local: dict, total: dict, model) -> tuple[jax.Array, jax.Array]:
    """(Switch aux loss, router z-loss) averaged over the layers stacked in the statistics.
    Aux = E * sum_e f_e * P_e with f_e, the fraction of assignments to expert e, from
    `total` and P_e, its mean router probability, from `local`; z from `local`."""
    fraction = total["counts"] / (total["tokens"][..., None] * model.top_k)
    mean_prob = local["prob_sum"] / local["tokens"][..., None]
    aux = jnp.mean(model.n_experts * jnp.sum(fraction * mean_prob, -1))
    return aux, jnp.mean(local["z_sum"] / local["tokens"])


def loss_terms(model, ce: jax.Array, stats: dict | None = None, replica_axes=(),
               share: float = 1.0, first_layer=0, mtp: jax.Array | None = None) -> jax.Array:
    """The `term_names` vector of one piece of work: mean cross-entropy `ce` of its tokens
    and the balance statistics `stats` [layers, ...] of the `share` of the model's layers it
    ran. The load fractions f_e count every replica's tokens (summed over `replica_axes`,
    without gradient); P_e and z this replica's, so the replicas' objectives average to
    the global losses and their gradients to one device's. The loads of its layers follow
    at their rows (from `first_layer`, stored order) of a [layers, E] table that summing
    the pieces completes. `mtp`: the piece's multi-token prediction cross-entropy, on the
    same scale as `ce` (None: zero, a piece that does not score). A piece that ran no
    experts (a pipeline chunk of a heterogeneous stack's dense blocks, `models.runs`) adds
    its cross-entropies only."""
    lead, objective = (ce,), ce
    if model.mtp_depth:
        mtp = jnp.zeros_like(ce) if mtp is None else mtp
        lead, objective = (ce, mtp), ce + model.mtp_weight * mtp
    if not model.n_experts:
        return jnp.stack((objective, *lead)) if model.mtp_depth else ce[None]
    if not stats:  # objective and cross-entropies, then zeros
        heads = jnp.stack((objective, *lead))
        return jnp.zeros(term_count(model), ce.dtype).at[:len(heads)].set(heads)
    total = jax.lax.stop_gradient(stats)
    if replica_axes:
        total = jax.lax.psum(total, replica_axes)
    aux, z = balance_losses(stats, total, model)
    aux_total, z_total = balance_losses(total, total, model)
    objective = objective + share * (model.aux_loss_weight * aux + model.z_loss_weight * z)
    terms = jnp.stack((objective, *lead, share * aux_total, share * z_total,
                       total["dropped"].sum(), total["tokens"].sum() * model.top_k))
    loads = jnp.zeros((model.moe_layers, model.n_experts), terms.dtype)
    loads = jax.lax.dynamic_update_slice(loads, total["counts"].astype(terms.dtype),
                                         (first_layer, 0))
    return jnp.concatenate((terms, loads.reshape(-1)))


def report(model, mean_terms: jax.Array) -> tuple[jax.Array, dict]:
    """(objective, metrics) from `loss_terms` averaged over the step's pieces: the raw sums
    become the dropped fraction and the load imbalance, the most-loaded expert over the
    mean of the worst layer (per layer: summed over layers, skews cancel)."""
    terms = dict(zip(term_names(model), mean_terms))
    objective = terms.pop(OBJECTIVE)
    if not model.n_experts:
        return objective, terms  # {} or the cross-entropy and the MTP loss
    loads = _loads(model, mean_terms)
    dropped, assigned = terms.pop(_DROPPED), terms.pop(_ASSIGNED)
    # A layer no piece ran (a test's partial statistics) has no load: ratio 0, not 0/0.
    per_layer = loads.max(-1) / jnp.maximum(loads.mean(-1), 1e-30)
    return objective, {**terms, DROPPED_FRACTION: dropped / assigned,
                       LOAD_IMBALANCE: jnp.max(per_layer)}


class StepResult(NamedTuple):
    """What a gradient path gives the optimizer step."""

    loss: jax.Array           # the objective (term 0), averaged over the global batch
    metrics: dict             # the reported terms (`report`)
    grads: Any                # laid out as the plan's gradient shardings
    loads: jax.Array | None   # per-layer expert loads for the routing biases (`layer_loads`)


class Objective(NamedTuple):
    """The objective as a gradient path uses it: the dense path (`jdist.step.grads`) and
    the pipeline schedule (`jdist.step.pipelined`) scale their pieces with `scale`, size
    their accumulators with `n_terms`, and end in `result`."""

    model: Any  # a ModelConfig

    @property
    def n_terms(self) -> int:
        return term_count(self.model)

    def scale(self, pieces: int, targets: jax.Array, axes) -> jax.Array:
        """`piece_scale` of `pieces` pieces, with the counted targets summed over `axes` (the
        manual axes the global batch is split over)."""
        return piece_scale(pieces, jax.lax.psum(token_count(targets), axes))

    def cross_entropy(self, mean_terms: jax.Array) -> jax.Array:
        """The cross-entropy among the terms, without balancing losses (evaluation)."""
        names = term_names(self.model)
        return mean_terms[names.index(CROSS_ENTROPY) if CROSS_ENTROPY in names else 0]

    def result(self, mean_terms: jax.Array, grads, micro: int) -> StepResult:
        """The step's result from the terms averaged over the global batch's `micro`
        micro-batches, and the gradients."""
        loss, metrics = report(self.model, mean_terms)
        return StepResult(loss, metrics, grads, layer_loads(self.model, mean_terms, micro))
