"""The collectives of jdist's context-parallel attention kernels
(`jdist.parallel.attention.context`: `ring`, `all_gather`, `ulysses`) and of the MoE dispatch
(`jdist.parallel.moe`), one layer of one micro-batch: derived from the kernels, which are
shard_maps. How often the compile runs them under remat is fitted (`partitioner.py`)."""

from __future__ import annotations

from jdist.models.moe import DROPLESS, GROUPED, capacity_of
from jdist.parallel.attention.context import ALL_GATHER, RING
from jdist.parallel.attention.ulysses import kv_repeats
from jdist.parallel.moe import keeps_exchanges
from jdist.plan.traffic import partitioner
from jdist.plan.traffic.layout import (
    A2A,
    AG,
    AR,
    F32,
    PERMUTE,
    RS,
    S32,
    Collective,
    Step,
    mesh_axes,
    resolved,
)
from jdist.spmd import axes as ax

# ---------------------------------------------------------------------------------------
# Context-parallel attention


def _kv_heads(st: Step) -> int:
    """Key/value heads per device (split over the axes the rules give kv heads)."""
    return st.model.n_kv_heads // st.size(resolved(st.plan, (ax.KV_HEADS,), 0))


def _kv(st: Step, tokens: int | None = None) -> int:
    """Elements of k (or v) per device: [rows, tokens, kv heads / tensor, head_dim]."""
    return st.rows * (tokens or st.tokens) * _kv_heads(st) * st.model.dim_per_head


def _q(st: Step) -> int:
    m = st.model
    return st.rows * st.tokens * (m.n_heads // st.size(st.tp)) * m.dim_per_head


def _ulysses_kv(st: Step) -> int:
    """k (or v) as ulysses moves it: kv heads repeated until they split over cp."""
    return _kv(st) * kv_repeats(_kv_heads(st), st.size(st.cp))


def _shift(st: Step, count: int, elements: int, dtype: str, source: str) -> Collective:
    """`ring_attention.Ring.shift` of one block: a permute, or inside a pipeline stage an
    all-gather of the whole ring's blocks (a permute there would pair with another
    stage's; see its docstring)."""
    if st.plan.pipeline is None:
        return Collective(PERMUTE, st.cp, count, elements, dtype, source)
    return Collective(AG, st.cp, count, elements * st.size(st.cp), dtype, source)


def attention_forward(st: Step) -> list[Collective]:
    """The context-parallel kernel's forward (jdist.parallel.attention.context)."""
    if not st.cp:
        return []
    n, dt = st.size(st.cp), st.dtype
    if st.plan.compute.cp_strategy == RING:  # ring_attention._forward: N-1 shifts of k and v
        return [_shift(st, 2 * (n - 1), _kv(st), dt, "ring_attention: k, v")]
    if st.plan.compute.cp_strategy == ALL_GATHER:  # all_gather_attention._local
        return [Collective(AG, st.cp, 2, _kv(st, st.seq), dt, "all_gather_attention: k, v")]
    return [Collective(A2A, st.cp, 2, _q(st), dt, "ulysses_attention: q, out"),
            Collective(A2A, st.cp, 2, _ulysses_kv(st), dt, "ulysses_attention: k, v")]


def attention_backward(st: Step) -> list[Collective]:
    """The kernel's backward: the ring again with dk/dv travelling along in float32 and a
    last shift home; all_gather's k/v gathered again and dk/dv reduce-scattered; ulysses'
    four all-to-alls reversed. Ring and ulysses first redo the kernel's forward where
    `partitioner.attention_recomputed` (all_gather's regathers are the backward's own)."""
    if not st.cp:
        return []
    n, dt = st.size(st.cp), st.dtype
    again = attention_forward(st) if partitioner.attention_recomputed(st) else []
    if st.plan.compute.cp_strategy == RING:
        return again + [_shift(st, 2 * (n - 1), _kv(st), dt, "ring_attention: k, v"),
                        _shift(st, 2 * n, _kv(st), F32, "ring_attention: dk, dv")]
    if st.plan.compute.cp_strategy == ALL_GATHER:
        return [Collective(AG, st.cp, 2, _kv(st, st.seq), dt, "all_gather_attention: k, v"),
                Collective(RS, st.cp, 2, _kv(st), dt, "all_gather_attention: dk, dv")]
    return again + [Collective(A2A, st.cp, 2, _q(st), dt, "ulysses_attention: dq, dout"),
                    Collective(A2A, st.cp, 2, _ulysses_kv(st), dt, "ulysses_attention: dk, dv")]


# ---------------------------------------------------------------------------------------
# MoE dispatch


def _moe_tokens(st: Step) -> int:
    """Tokens one device routes per layer and micro-batch."""
    return st.rows * st.seq // st.size(st.cp + st.sp)


def _moe_buffer(st: Step) -> int:
    """Elements of one device's dispatch buffer [experts, capacity, d_model]
    (all its tokens when dropless)."""
    m = st.model
    capacity = capacity_of(_moe_tokens(st), m, m.moe_routing == DROPLESS)
    return m.n_experts * capacity * m.d_model


def _moe_moves(st: Step, backward: bool) -> list[Collective]:
    """jdist.parallel.moe: the dispatch buffer all-to-all'ed to the experts' devices and
    back over the expert axes, the experts' output summed over the tensor axes splitting
    their hidden units; backward the same reversed, with gate's and up's input gradients
    summed separately (as jax 0.10.2 transposes the kernel). Grouped routing sums the
    tokens [T, d] once each way (`models.grouped`)."""
    ep = resolved(st.plan, (ax.EXPERTS,), 0)
    tp = resolved(st.plan, (ax.EXPERTS, ax.EMBED, ax.MLP), 2)
    if st.model.moe_routing == GROUPED:
        return _grouped_moves(st, ep, tp, backward)
    out = []
    if ep:
        out.append(Collective(A2A, ep, 2, _moe_buffer(st), st.dtype, "moe: dispatch, combine"))
    if tp:
        out.append(Collective(AR, tp, 2 if backward else 1, _moe_buffer(st), st.dtype,
                              "moe: expert hidden units"))
    return out


def _grouped_moves(st: Step, ep, tp, backward: bool) -> list[Collective]:
    """Grouped routing: the mixed tokens [T, d] summed over tp once each way; with ep, one
    round of jdist.parallel.expert_rounds (all of it near balance): rows out and outputs back
    (and the rows' expert ids) forward, output and input gradients backward."""
    from jdist.parallel.expert_rounds import round_capacity

    m = st.model
    tokens = _moe_tokens(st)
    out = [Collective(AR, tp, 1, tokens * m.d_model, st.dtype, "moe: expert hidden units")] \
        if tp else []
    if ep:
        slots = st.size(ep) * round_capacity(tokens * m.top_k, st.size(ep))
        out.append(Collective(A2A, ep, 2, slots * m.d_model, st.dtype, "moe: rounds"))
        if not backward:
            out.append(Collective(A2A, ep, 1, slots, S32, "moe: rounds' expert ids"))
    return out


def moe_forward(st: Step) -> list[Collective]:
    """The MoE kernel's forward, and its balance statistics (2 E + 2 floats) summed over
    the kernel's token axes."""
    m = st.model
    if not st.moe:
        return []
    tokens = mesh_axes(set(st.bt) | set(st.cp) | set(st.sp), st.plan.mesh)
    stats = [Collective(AR, tokens, 1, 2 * m.n_experts + 2, F32, "moe: balance sums")]
    return _moe_moves(st, False) + (stats if tokens else [])


def moe_backward(st: Step) -> list[Collective]:
    """The MoE kernel's backward; `--remat full` redoes its forward first (not checked
    against a compile), but for the expert all-to-alls where it keeps their outputs
    (`parallel.moe.keeps_exchanges`)."""
    if not st.moe:
        return []
    plan = st.plan
    kept = keeps_exchanges(plan.compute.remat, plan.model, dict(plan.mesh.shape))
    again = [c for c in _moe_moves(st, False) if c.kind != A2A or not kept] \
        if plan.compute.remat == "full" else []
    return again + _moe_moves(st, True)
