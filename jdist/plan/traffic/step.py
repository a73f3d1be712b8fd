"""The whole step: jdist's own collectives (`exact.py`, `kernels.py`) and what the compile
adds (`partitioner.py`), counted as often as the training step runs them, plain
(`jdist.step.grads`) or pipelined (`jdist.step.pipelined`)."""

from __future__ import annotations

from collections.abc import Callable

from jdist.models.names import FINAL_NORM
from jdist.parallel import prefetch
from jdist.parallel.pipeline import stashes
from jdist.plan.traffic import exact, partitioner
from jdist.plan.traffic.exact import gather, reduce
from jdist.plan.traffic.kernels import (
    attention_backward,
    attention_forward,
    moe_backward,
    moe_forward,
)
from jdist.plan.traffic.layout import PIPE_MANUAL, Collective, Leaf, Step, step_of
from jdist.spmd import axes as ax
from jdist.step.grads import MANUAL


def collectives(plan, batch_size: int, seq_len: int, executed: bool = True) -> list[Collective]:
    """Every modelled collective of one step. `executed` False: a pipeline's collectives
    inside the stage's branches once each, as `jdist.tools.comm.report` counts them."""
    st = step_of(plan, batch_size, seq_len)
    return pipelined_step(st, executed) if plan.pipeline is not None else plain_step(st)


# ---------------------------------------------------------------------------------------
# One transformer layer (models/llama.py Block) of one micro-batch


def layer_gathers(st: Step, source: str = "grad_sync.gather") -> list[Collective]:
    """A layer's parameters gathered (each leaf the replica axes split)."""
    return [c for leaf in st.blocks() for c in gather(st, leaf, source)]


def prefetched(st: Step, layers: int) -> bool:
    """Whether a loop of `layers` runs `jdist.parallel.prefetch`: then a forward gathers
    layers + 1 (the last again, for the backward to start with), a backward layers - 1,
    whatever the remat policy; `layer_forward`'s and `layer_backward`'s gathers are not
    counted (`prefetch_gathers`)."""
    return prefetch.applies(st.plan.compute.prefetch, st.plan.mesh,
                            [leaf.sync for leaf in st.blocks()], layers)


def prefetch_gathers(layers: int) -> tuple[int, int]:
    """Layer gathers of a prefetching forward and backward: (inside its loops, at fixed
    layers). 2 x layers + 1 in all: the forward's loop gathers each layer after the first
    (and the last again), the backward's layers - 2; the forward's first gather and the
    backward's first two are of fixed layers, which XLA hoists out of a micro-batch scan
    (fitted, jax 0.10.2). With two layers the backward takes both from the forward: 3."""
    if layers == 2:
        return 2, 1
    return 2 * layers - 2, 3


def layer_forward(st: Step, gathers: bool = True) -> list[Collective]:
    """A layer's forward: its parameters gathered, Megatron's activation collectives, the
    context-parallel kernel's, the MoE dispatch's."""
    out = layer_gathers(st) if gathers else []
    return out + kernels(st, partitioner.tensor_forward(st) + attention_forward(st)
                         + moe_forward(st))


def kernels(st: Step, collectives: list[Collective]) -> list[Collective]:
    """A block's activation collectives, once per block of a row of the stack (a periodic
    run's period, `models.runs`); its parameters' gathers and reductions are the row's."""
    period = st.run.period if st.run is not None else 1
    return [c.times(period) for c in collectives]


def layer_backward(st: Step, defer: bool, merged: Callable[[Leaf], bool] = lambda _: False,
                   regather: bool = True) -> list[Collective]:
    """A layer's backward: parameters gathered again (`partitioner.regathers`; not those
    whose regather XLA `merged` with an earlier identical gather), recomputation,
    Megatron's, the attention kernel's and the MoE dispatch's backward, gradient
    reductions."""
    out = [c for leaf in st.blocks() if regather and partitioner.regathers(st, leaf)
           and not merged(leaf) for c in gather(st, leaf, "grad_sync.gather (backward)")]
    out += kernels(st, partitioner.tensor_backward(st) + attention_backward(st)
                   + moe_backward(st))
    for leaf in st.blocks():
        out += partitioner.token_partials(st, leaf) + reduce(st, leaf, defer)
    return out


# ---------------------------------------------------------------------------------------
# The whole step


def plain_step(st: Step) -> list[Collective]:
    """jdist.step.grads: the replica shard_map, `grad_accum` micro-batches scanned."""
    defer, per_micro, once = st.micro > 1, [], []
    for run in st.runs():  # each run of blocks is its own layer loop (models.runs)
        layers = run.run.rows  # a periodic run's rows are periods: `kernels` count its blocks
        pre = prefetched(run, layers)
        per_micro += [c.times(layers) for c in layer_forward(run, gathers=not pre)
                      + layer_backward(run, defer, regather=not pre)]
        looped, fixed = prefetch_gathers(layers) if pre else (0, 0)
        per_micro += [c.times(looped) for c in layer_gathers(run)] if pre else []
        once += [c.times(fixed) for c in layer_gathers(run)] if pre else []
    per_micro += exact.embedding_forward(st) + exact.embedding_backward(st, defer)
    per_micro += exact.final_norm_grad(st, defer)
    extras = partitioner.extras(st)
    per_micro += exact.balance_totals(st) + extras.embed_forward + extras.embed_backward
    per_micro += extras.loss_forward + extras.loss_backward
    # The final norm's gather is loop-invariant: XLA hoists it out of the micro-batch scan
    # and merges the backward's with it (once per step; fitted, jax 0.10.2).
    once += gather(st, st.leaf(FINAL_NORM), "grad_sync.gather (final norm)")
    shape = exact.loss_shape(st)
    if shape is None:
        once += gather(st, st.head, "grad_sync.gather (head)")
        per_micro += reduce(st, st.head, defer, "grad_sync.reduce (head)")
    else:
        per_micro += exact.loss_forward(st, shape) + exact.loss_backward(st, shape, defer)
        if shape.n_chunks == 1:  # forward's and backward's gathers merged, and hoisted
            once += exact.head_gathers(st, shape)
        else:  # inside the forward's and the backward's chunk loops
            per_micro += [c.times(2) for c in exact.head_gathers(st, shape)]
    out = [c.times(st.micro) for c in per_micro] + once + extras.per_step
    if defer:
        out += exact.finish_all(st)
    return out + partitioner.zero_update(st) + partitioner.muon_owners(st) \
        + exact.loss_scalars(st, MANUAL) \
        + partitioner.grad_norm(st)


def chunk_recompute(st: Step, k: int, gathers: bool = True) -> list[Collective]:
    """The forward a pipeline backward redoes (jax.vjp of the chunk), its ring shifts
    merged with the backward's where `partitioner.ring_merges`."""
    out = (layer_gathers(st) if gathers else []) + partitioner.tensor_forward(st)
    return out + ([] if partitioner.ring_merges(st) else attention_forward(st)) + moe_forward(st)


def chunk_kinds(st: Step, table, executed: bool) -> list[tuple[Step, int, int]]:
    """(the chunk's layers, rows of the stack in one chunk, times a chunk runs): the
    stack's P x V equal chunks, or a heterogeneous stack's, one per run and stage
    (`jdist.step.pipelined`: chunk v is run v's, under a `lax.switch`, each branch counted
    once by the report)."""
    model_runs = st.runs()
    if len(model_runs) > 1:
        return [(r, r.run.rows // table.stages, table.micro if executed else 1)
                for r in model_runs]
    one = model_runs[0]
    return [(one, one.run.rows // (table.stages * table.virtual),
             table.micro * table.virtual if executed else 1)]


def pipelined_step(st: Step, executed: bool) -> list[Collective]:
    """jdist.step.pipelined + stage_program: per tick a forward or backward of one chunk
    of k = L / (P V) layers inside a `lax.switch`, then two permutes; under `--remat full`
    a backward redoes its chunk's forward (jax.vjp) before pulling the cotangent back,
    otherwise it reads the forward's residuals (`stashes`; gathered parameters are never
    among them: it gathers again). The embedding runs in the first chunk, the final norm
    and loss in the last; gradients accumulate (defer), shared ones are summed over stage
    once."""
    table = st.plan.pipeline.table(st.n[ax.STAGE])
    redo = not stashes(st.plan.compute.remat)
    chunks = chunk_kinds(st, table, executed)
    # The embedding and the loss run in the first and last chunk; a heterogeneous stack's
    # chunk traces them in each run's branch, which the report counts once each.
    end_runs = table.micro if executed else len(chunks)
    out = []
    for chunk, k, chunk_runs in chunks:
        pre = prefetched(chunk, k)
        forward = [c.times(k) for c in layer_forward(chunk, gathers=not pre)]
        forward += [c.times(k + 1) for c in layer_gathers(chunk)] if pre else []
        # A one-layer chunk's backward regathers what its recomputed forward just gathered:
        # XLA merges the two where no automatic axis splits the leaf (fitted, jax 0.10.2).
        again = chunk_recompute(chunk, k, gathers=not pre) if redo else []
        backward = [c.times(k) for c in again + layer_backward(
            chunk, True, merged=lambda leaf, k=k: redo and k == 1 and not leaf.auto,
            regather=not pre)]
        backward += [c.times(sum(prefetch_gathers(k))) for c in layer_gathers(chunk)] \
            if pre else []
        out += [c.times(chunk_runs) for c in forward + backward]
    extras = partitioner.extras(st)
    first = exact.embedding_forward(st) + extras.embed_forward
    first_back = (first if redo else []) + exact.embedding_backward(st, True) \
        + extras.embed_backward
    norm = gather(st, st.leaf(FINAL_NORM), "grad_sync.gather (final norm)")
    shape = exact.loss_shape(st)
    if shape is None:
        last = norm + gather(st, st.head, "grad_sync.gather (head)")
        last_back = last + reduce(st, st.head, True, "grad_sync.reduce (head)")
    else:  # a redone forward redoes the loss's too (log-sum-exp only); then its backward
        heads = exact.head_gathers(st, shape)
        last = norm + heads + exact.loss_forward(st, shape)
        last_back = norm + (heads + exact.loss_forward(st, shape, picked=False) if redo
                            else []) + heads + exact.loss_backward(st, shape, True)
    last += extras.loss_forward
    last_back += exact.final_norm_grad(st, True) + extras.loss_recompute \
        + extras.loss_backward + extras.loss_backward_again
    out += [c.times(end_runs) for c in first + first_back + last + last_back]
    out += extras.per_step + exact.stage_permutes(st, table.ticks) + exact.stage_sums(st)
    out += exact.finish_all(st, table.stages)
    return out + partitioner.zero_update(st) + partitioner.muon_owners(st) \
        + exact.loss_scalars(st, PIPE_MANUAL) \
        + partitioner.grad_norm(st)
