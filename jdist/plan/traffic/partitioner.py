"""What compiling the step adds to jdist's own collectives, fitted to jax 0.10.2 on CPU:
mostly GSPMD's partitioning of the automatic axes (Megatron's tensor-parallel
all-reduces, sequence parallelism's all-gathers, the token axes' partial sums, the
collectives around the embedding and the loss, the ZeRO-1/2 update's gathers, the
gradient norm's scalars), and a few rewrites of XLA's and of jax's remat that change how
often jdist's collectives run.

Found by compiling steps and reading `jdist.tools.comm.report` (tests/test_plan_traffic.py keeps
it honest), not derived from the code: a later jax, or the GPU compiler, may partition
differently. Each function's docstring names the version it was fitted on; the compiled
numbers of `jdist.tools.gpu_report` / `jdist.tools.hlo` are what should replace them.
"""

from __future__ import annotations

import dataclasses

from jdist.models.names import EMBED
from jdist.parallel.attention.context import RING
from jdist.plan.traffic.layout import (
    A2A,
    AG,
    AR,
    F32,
    PERMUTE,
    S32,
    Collective,
    Leaf,
    Step,
    embed_split,
    vocab_axes,
)
from jdist.spmd import axes as ax
from jdist.step import muon_cost

# ---------------------------------------------------------------------------------------
# GSPMD inside the layers


def token_partials(st: Step, leaf: Leaf) -> list[Collective]:
    """Fitted (GSPMD, jax 0.10.2): where automatic axes split the tokens a weight
    gradient sums over, GSPMD all-reduces the partial sums there, before grad_sync's
    reductions: over the context-parallel axes and the automatic batch axes (expert) for
    every leaf they do not split (in the dtype of the dot that made it; norm scales in
    float32), over Megatron SP's tensor for the norm scales (the matrices see tokens
    gathered over tensor)."""
    axes = set(st.cp) | set(st.bt) | (set() if leaf.matrix else set(st.sp))
    axes = tuple(a for a in st.plan.mesh.axis_names if a in axes and a not in leaf.auto)
    if not (leaf.trained and axes):
        return []
    return [Collective(AR, axes, 1, leaf.local, st.dtype if leaf.matrix else leaf.dtype,
                       "GSPMD: gradient partial sums over token axes")]


def tensor_forward(st: Step) -> list[Collective]:
    """Fitted (GSPMD, jax 0.10.2), Megatron: the row-parallel attention-output and
    MLP-down projections each all-reduce [rows, tokens, d_model] over tensor; with
    sequence parallelism the normed inputs of attention and MLP are first all-gathered
    over it."""
    if not st.tp:
        return []
    if st.collective_matmul:
        return _chunk_transfers(st, 4) + _lora_partials(st, ("o", "down"))
    dense = 0 if st.moe else 1  # an MoE MLP reduces inside its kernel
    out = [Collective(AR, st.tp, 1 + dense, st.act, st.dtype,
                      "GSPMD: Megatron row-parallel outputs")]
    out += _lora_partials(st, ("o", "down"))
    if st.sp:
        out.append(Collective(AG, st.sp, 2, st.act, st.dtype, "GSPMD: sequence-parallel inputs"))
    return out


def tensor_backward(st: Step) -> list[Collective]:
    """Fitted (GSPMD, jax 0.10.2): the input gradients of q, k, v, gate and up are each
    all-reduced over tensor (5, not 2: the partial sums are not added first); with SP, 4
    blocks are gathered. `--remat full` redoes the attention output's all-reduce (the
    MLP's is dead code there); the selective and dots policies keep the projections."""
    if not st.tp:
        return []
    again = 1 if st.plan.compute.remat == "full" else 0
    if st.collective_matmul:  # the widening inputs' chunks again (the residuals are shards);
        # under remat full the whole forward again, but for the MLP's down (dead there)
        return _chunk_transfers(st, 4 + 2 + again) + _lora_partials(
            st, ("q", "k", "v", "gate", "up") + (("o",) if again else ()))
    dense = 0 if st.moe else 2
    out = [Collective(AR, st.tp, 3 + dense + again, st.act, st.dtype,
                      "GSPMD: Megatron input grads")]
    out += _lora_partials(st, ("q", "k", "v", "gate", "up") + (("o",) if again else ()))
    if st.sp:
        out.append(Collective(AG, st.sp, 4, st.act, st.dtype, "GSPMD: sequence-parallel grads"))
    return out


def _chunk_transfers(st: Step, projections: int) -> list[Collective]:
    """Exact (`jdist.parallel.collective_matmul`): each projection moves its input's length
    chunks (q/k/v and gate/up share them) or its partial sums over `tensor`, n-1 transfers
    of [rows, tokens / n, d_model]; instead of SP's gathers and Megatron's reductions
    (compiled on the GPU target, jax 0.10.2)."""
    n = st.size(st.sp)
    return [Collective(PERMUTE, st.sp, projections * (n - 1), st.act // n, st.dtype,
                       "collective_matmul: chunk transfers")]


def _lora_partials(st: Step, projections: tuple[str, ...]) -> list[Collective]:
    """Fitted (GSPMD, jax 0.10.2), LoRA (models/lora.py) beside each of those Megatron
    all-reduces: x·A of a row-parallel projection, and the gradient through B of a
    column-parallel one, are partial sums over tensor too: [rows, tokens, rank] each."""
    lora = st.model.lora
    if lora is None:
        return []
    n = sum(1 for t in projections if t in lora.targets)
    return [Collective(AR, st.tp, n, st.act // st.model.d_model * lora.rank, st.dtype,
                       "GSPMD: LoRA adapter partial sums")] if n else []


# ---------------------------------------------------------------------------------------
# GSPMD outside the layers, per micro-batch: around the embedding and the loss


@dataclasses.dataclass(frozen=True)
class Extras:
    """What GSPMD adds around the embedding and the loss when an automatic axis splits the
    sequence (Megatron SP's tensor, context parallelism's sequence) or the batch, by
    where it runs."""

    embed_forward: list[Collective] = dataclasses.field(default_factory=list)
    embed_backward: list[Collective] = dataclasses.field(default_factory=list)
    loss_forward: list[Collective] = dataclasses.field(default_factory=list)
    loss_recompute: list[Collective] = dataclasses.field(default_factory=list)
    loss_backward: list[Collective] = dataclasses.field(default_factory=list)
    # What a pipeline's backward, a computation apart from its forward, gathers again.
    loss_backward_again: list[Collective] = dataclasses.field(default_factory=list)
    per_step: list[Collective] = dataclasses.field(default_factory=list)

    def __add__(self, other: Extras) -> Extras:
        return Extras(*(getattr(self, f.name) + getattr(other, f.name)
                        for f in dataclasses.fields(self)))


def extras(st: Step) -> Extras:
    """Everything GSPMD adds outside the layers (fitted, jax 0.10.2)."""
    return sequence_parallel_extras(st) + context_parallel_extras(st) + batch_split_extras(st)


def sequence_parallel_extras(st: Step) -> Extras:
    """Fitted (GSPMD, jax 0.10.2), Megatron SP outside the layers: the token ids (for
    the lookup) and the targets, the loss's hidden states (compute dtype) and the per-token
    loss gradient are gathered over tensor, and so are the embedding's row gradients
    (float32; a split table's also after its all-to-all); the loss sum and the token
    count are all-reduced there."""
    if not st.sp:
        return Extras()
    tokens, d, sp = st.rows * st.seq, st.model.d_model, st.sp
    split = 1 if embed_split(st) else 0
    hidden = Collective(AG, sp, 1, tokens * d, st.dtype, "GSPMD/SP: loss hidden states")
    targets = Collective(AG, sp, 1, tokens, S32, "GSPMD/SP: targets")
    return Extras(
        embed_forward=[Collective(AG, sp, 1, tokens, S32, "GSPMD/SP: token ids")],
        embed_backward=[Collective(AG, sp, 1 + split, tokens * d, F32,
                                   "GSPMD/SP: embedding gradients")],
        loss_forward=[hidden, targets, Collective(AR, sp, 1, 1, F32, "GSPMD/SP: loss sum")],
        loss_recompute=[hidden],
        loss_backward=[Collective(AG, sp, 1, tokens, F32, "GSPMD/SP: loss gradient per token")],
        loss_backward_again=[hidden, targets],
        per_step=[Collective(AR, sp, 1, 1, S32, "GSPMD/SP: token count")])


def context_parallel_extras(st: Step) -> Extras:
    """Fitted (GSPMD, jax 0.10.2), context parallelism outside the layers: the ring's
    reorder gathers token ids and targets whole (context.reorder_tokens); the embedding's
    backward gathers ids (unless the reorder did, for a vocab-parallel lookup) and the rows'
    gradients over the sequence, a split table's gathered ids and rows too; the loss sum
    and the token count are all-reduced there."""
    if not st.cp:
        return Extras()
    tokens, d, cp = st.rows * st.seq, st.model.d_model, st.cp
    split, ring = embed_split(st), st.plan.compute.cp_strategy == RING
    ids = 0 if ring and vocab_axes(st, st.leaf(EMBED), 0) else 1
    backward = [Collective(AG, cp, ids, tokens, S32, "GSPMD/CP: embedding ids"),
                Collective(AG, cp, 1, tokens * d, F32, "GSPMD/CP: embedding row gradients")]
    if split:
        backward += [
            Collective(AG, cp, 1, tokens * st.size(split), S32, "GSPMD/CP: gathered ids"),
            Collective(AG, cp, 1, tokens * d, st.dtype, "GSPMD/CP: embedding rows"),
            Collective(AG, cp, 1, tokens * d, F32, "GSPMD/CP: embedding row gradients")]
    per_step = [Collective(AR, cp, 1, 1, S32, "GSPMD/CP: token count")]
    if ring:  # the whole batch's ids and targets, every micro-batch's at once
        per_step.append(Collective(AG, cp, 2, tokens * st.micro, S32, "context.reorder_tokens"))
    return Extras(embed_backward=backward,
                  loss_forward=[Collective(AR, cp, 1, 1, F32, "GSPMD/CP: loss sum")],
                  per_step=per_step)


def batch_split_extras(st: Step) -> Extras:
    """Fitted (GSPMD, jax 0.10.2): an automatic axis splitting the batch (expert, which
    is data parallel outside the experts) has the embedding's backward gather the ids and
    the rows' gradients of its rows over it, and the token count and loss sum reduced
    there, as context parallelism does over the sequence."""
    if not st.bt:
        return Extras()
    tokens, d, bt = st.rows * st.size(st.bt) * st.seq, st.model.d_model, st.bt
    return Extras(
        embed_backward=[Collective(AG, bt, 1, tokens, S32, "GSPMD/batch: embedding ids"),
                        Collective(AG, bt, 1, tokens * d, F32, "GSPMD/batch: row gradients")],
        loss_forward=[Collective(AR, bt, 1, 1, F32, "GSPMD/batch: loss sum")],
        per_step=[Collective(AR, bt, 1, 1, S32, "GSPMD/batch: token count")])


# ---------------------------------------------------------------------------------------
# GSPMD once per step: the optimizer update


def zero_update(st: Step) -> list[Collective]:
    """Fitted (GSPMD, jax 0.10.2), ZeRO-1/2: the optimizer updates each parameter's data
    shard, and GSPMD all-gathers the updated parameter over data into its stored layout
    (float32)."""
    if st.plan.zero not in (1, 2) or st.n[ax.DATA] == 1:
        return []
    return [Collective(AG, (ax.DATA,), 1, leaf.stored, F32, "GSPMD: ZeRO-1/2 update")
            for leaf in st.leaves if leaf.trained and leaf.zero_split]


def muon_owners(st: Step) -> list[Collective]:
    """Fitted (jax 0.10.2: tiny on fsdp=2, CPU; llama3-8b on fsdp=8, the H100 compiler: 6.0x
    both), `--optimizer muon`: the owner layout (`jdist.step.muon`) moves gradient,
    momentum and update between the plan's layout and the owners', all-to-alls of six times
    the owned matrices' float32 elements, when one mesh axis both shards the momentum and
    owns its layers. Not modelled: moves over several axes (GSPMD, jax 0.10.2, replicates
    and re-partitions them: all-gathers, "involuntary full rematerialization")."""
    plan = st.plan
    moves = muon_cost.owner_moves(plan.abstract.opt_state, plan.opt_device_shardings,
                             dict(plan.mesh.shape), plan.names)
    return [Collective(A2A, stored, 6, elements, F32, "Muon: owner layout")
            for elements, owners, stored in moves if len(owners) == 1 and owners == stored]


def grad_norm(st: Step) -> list[Collective]:
    """Fitted (GSPMD and XLA, jax 0.10.2): the gradient norm's partial sums of squares
    all-reduced, twice per trained leaf (optax's clipping and the grad_norm metric are not
    merged) and per dimension it is split on."""
    return [Collective(AR, group, 2, 1, F32, "optax: gradient norm")
            for leaf in st.leaves if leaf.trained for group in leaf.grad_groups]


# ---------------------------------------------------------------------------------------
# XLA and jax's remat: how often jdist's own collectives run


def regathers(st: Step, leaf: Leaf) -> bool:
    """Whether a layer's backward gathers this leaf again. Gathered parameters are never
    kept for the backward (jdist.models.remat.GATHERED) except under `everything_saveable`.
    Fitted (jax 0.10.2): with `--remat none` a norm scale is not regathered either: its
    backward reads the broadcast scale, which that policy keeps."""
    if st.plan.compute.remat == "everything_saveable":
        return False
    return leaf.matrix or st.plan.compute.remat != "none"


def ring_merges(st: Step) -> bool:
    """Fitted (XLA, jax 0.10.2): a ring of two devices has no loop left, and the shifts
    of k and v a recomputed forward runs are the backward's first ones, merged."""
    return st.plan.compute.cp_strategy == RING and st.size(st.cp) == 2


def attention_recomputed(st: Step) -> bool:
    """Fitted (jax 0.10.2): every remat policy but none and everything_saveable redoes the
    context-parallel kernel's forward before its backward: its custom-VJP residuals (out,
    lse) carry no name a policy keeps. Not where `ring_merges`."""
    return st.plan.compute.remat not in ("none", "everything_saveable") and not ring_merges(st)

