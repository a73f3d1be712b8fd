"""What one layout costs, predicted without compiling: memory per device, the FLOPs a
device executes, the time of compute, memory-bound work, communication and pipeline
bubble, and which of them bounds the step.

The model (every term is a function below, each checked by `benchmarks/planner.py`):

  compute      executed FLOPs per device / the profile's achievable FLOP/s. Executed, not
               model FLOPs: recomputation counts (`--remat full` re-runs each block's
               forward, and a pipeline backward its chunk's before that; `selective` its
               attention scores), so does the chunked loss's recomputed head, and causal blocks the
               kernel skips do not (flash and the ring skip tiles above the diagonal; dense
               `xla` attention computes every score and masks).
  overhead     what a step costs whatever its size (`profile.step_overhead_ms`: the CPU
               runtime's dispatch and per-operation costs; 0 on GPUs).
  memory-bound the optimizer update reads parameters, gradients and both moments and writes
               parameters and moments (HBM bandwidth); `--offload optimizer` moves the
               moments to the device and back each step (host link bandwidth).
  comm         `traffic.step_traffic` rows priced by `jdist.tools.comm.transfer_time` on the link
               each row's mesh axes cross (ICI within a host, DCN across). Overlap
               assumption, per collective: the replica-axis gathers and gradient reductions
               (over `data`/`fsdp` only) are issued per layer inside the layer loop and may
               run under the neighbouring layers' compute, so a fraction `profile.overlap` of
               their time hides; ring-attention permutes hide the same way under their
               attention blocks, and the collective matmuls' transfers over tensor
               (sequence parallelism on GPUs) under their chunks' matmuls. Tensor-parallel
               activation reductions, all-to-alls and pipeline permutes sit between
               dependent matmuls: `profile.overlap_tensor` of them hides
               (0 in every shipped profile: exposed), but the expert exchanges, which
               hide on GPUs by `--moe-overlap`'s pieces (`jdist.parallel.moe.exposed_share`).
               Together no more hides than the compute lasts.
  bubble       a pipelined step's work is spread over the executed schedule's ticks (the
               schedule simulator's table, `jdist.parallel.pipeline.schedule`), each as long as its
               slowest operation; the idle share stretches compute and exposed
               communication by 1 / (1 - bubble) (`pipeline_bubble`) — on dedicated
               devices: where devices share cores (`cpu-sim`) an idle stage's core runs
               another stage's work, and only the total work counts.
  muon         `--optimizer muon` adds its Newton-Schulz FLOPs to the compute
               (`jdist.step.muon_cost.newton_schulz_per_device`); its all-to-alls are traffic
               rows (`jdist.plan.traffic.partitioner.muon_owners`; docs/muon.md).
"""

from __future__ import annotations

import dataclasses
import math

from jdist.memory import Breakdown
from jdist.models.loss import CHUNKED
from jdist.parallel.attention.blockwise import Q_TILE
from jdist.parallel.moe import expert_factor, exposed_share, overlap_pieces, pieces_hide
from jdist.parallel.pipeline import stashes
from jdist.plan.layouts import Layout
from jdist.plan.traffic import group_size
from jdist.runtime.target import overlap_by_default
from jdist.spmd import axes as ax
from jdist.step.muon_cost import newton_schulz_per_device
from jdist.tools.comm import Row, transfer_time
from jdist.tools.throughput import attention_params, flops_per_token, score_flops


@dataclasses.dataclass
class Estimate:
    """The predicted cost of one layout (per device, per optimizer step)."""

    layout: Layout
    memory: Breakdown
    flops: float              # executed FLOPs per device per step
    compute_s: float
    memory_bound_s: float
    comm: list[tuple[Row, float, bool]]  # (row, seconds, may hide under compute)
    bubble: float
    step_s: float
    tokens_per_s: float
    mfu: float                # model FLOPs (jdist.tools.throughput) over peak
    bottleneck: str
    hidden: tuple[float, ...]  # each comm row's share of time under compute

    @property
    def comm_s(self) -> float:
        return sum(s for _, s, _ in self.comm)

    @property
    def exposed_share(self) -> float:
        """The predicted share of collective bytes not hidden: what `jdist.tools.gpu_report`
        measures on the compiled step, for comparison (`benchmarks/overlap.py`)."""
        total = sum(row.bytes for row, _, _ in self.comm)
        return sum(row.bytes * (1 - h) for (row, _, _), h in zip(self.comm, self.hidden)) \
            / total if total else 0.0


def attention_fraction(attention: str, seq_len: int) -> float:
    """Fraction of the full [S, S] score matrix a causal kernel computes: blockwise kernels
    skip [Q_TILE, Q_TILE] tiles above the diagonal; dense attention computes all of it."""
    if attention == "xla":
        return 1.0
    n = math.ceil(seq_len / Q_TILE)
    return (n + 1) / (2 * n)


def executed_flops(model, seq_len: int, tokens: float, attention: str, remat: str,
                   pipelined: bool, loss: str, stages: int, experts: float = 1.0) -> float:
    """FLOPs one pipeline stage (the whole model when `stages` is 1) executes for `tokens`
    tokens: blocks / stages, plus the head and loss on the last stage (the slowest);
    `experts`: the MoE experts' executed over routed FLOPs (`expert_factor`)."""
    per_token = flops_per_token(model, seq_len)
    head = 6.0 * model.d_model * model.vocab_size
    # Executed: MLA's values are padded to head_dim for the kernels (models.mla).
    scores = 12.0 * (model.n_layers + model.mtp_depth) * model.n_heads * model.dim_per_head \
        * seq_len
    routed = 3.0 * routed_forward(model)
    blocks_matmul = per_token - head - score_flops(model, seq_len) + routed * (experts - 1)
    if model.lora is not None:  # a frozen base needs no weight gradient: 4 of the 6
        blocks_matmul *= 4 / 6
    scores *= attention_fraction(attention, seq_len)
    forward = blocks_matmul / 3 + scores / 3          # one forward of the blocks
    # A pipeline stage under --remat full recomputes its chunk before the backward (and
    # each layer again inside it); under the other policies it reads the forward's stash.
    recompute = (forward if pipelined and not stashes(remat) else 0.0) + {
        "full": forward, "selective": scores / 3}.get(remat, 0.0)
    if loss == CHUNKED:  # the custom VJP recomputes each vocabulary chunk's logits
        head += 2.0 * model.d_model * model.vocab_size
    return tokens * ((blocks_matmul + scores + recompute) / stages + head)


def routed_forward(model) -> float:
    """One forward's FLOPs per token of the routed experts' matmuls (gate, up, down for
    each of the top-k), over all layers."""
    return 6.0 * model.moe_layers * model.d_model * model.d_ff * model.top_k


def fp8_flops(model, tokens: float, remat: str, pipelined: bool, stages: int,
              experts: float = 1.0) -> float:
    """Of one stage's `executed_flops`, what `--fp8` runs at the FP8 rate (`jdist.quant.fp8`):
    the dense block projections' forward and backward, and the routed experts' forward and
    input gradient (their weight gradient stays in the compute dtype) at `experts` times
    the routed FLOPs (`expert_factor`); plus the forward recomputed under `--remat full`
    and pipelined from the chunk input. The recomputed forward lacks a dense model's down
    projection, whose output no backward reads; an MoE layer's down output weighs the
    router's gradient, so it is recomputed too (a shared expert's down output is unread
    unless gated, as a dense model's: reasoned, not compiled). Equal to the GPU-compiled
    step's FP8 gemm FLOPs, dense and MoE (tests/test_gpu_report.py)."""
    d, layers, dense_layers = model.d_model, model.n_layers, model.n_layers - model.moe_layers
    # The dense SwiGLUs' widths over all layers: a dense block's, a block's shared expert.
    dense_width = dense_layers * (model.dense_d_ff or model.d_ff)
    shared_width = model.moe_layers * model.shared_d_ff
    dense = 2.0 * (layers * attention_params(model) + 3 * d * (dense_width + shared_width))
    routed = routed_forward(model) * experts
    passes = 3.0 if model.lora is None else 2.0  # a frozen base: no weight gradients
    # The last dense down projection: a dense block's, or an ungated shared expert's.
    unread = 2.0 * d * (dense_width + (0 if model.shared_gate else shared_width))
    recompute = (dense + routed - unread if remat == "full" else 0.0) \
        + (dense + routed if pipelined and not stashes(remat) else 0.0)
    return tokens * (passes * dense + 2.0 * routed + recompute) / stages


def model_flops(model, seq_len: int, tokens: float) -> float:
    """Model FLOPs (PaLM's convention, what MFU counts)."""
    return tokens * flops_per_token(model, seq_len)


def hideable(row: Row) -> bool:
    """May this row run under the layer loop's compute (see the module docstring)?"""
    if set(row.axes) <= set(ax.REPLICA_AXES) and row.kind in (
            "all-gather", "reduce-scatter", "all-reduce"):
        return True
    # Ring attention's and the collective matmuls' transfers, each beside a block's matmuls.
    return row.kind == "collective-permute" and set(row.axes) in ({ax.SEQUENCE}, {ax.TENSOR})


def expert_exchange(row: Row, plan) -> bool:
    """Is this row a MoE layer's expert all-to-alls (over the expert axis)?"""
    return bool(plan.model.n_experts) and row.kind == "all-to-all" and ax.EXPERT in row.axes


def moe_pieces(plan) -> int:
    """Pieces of each expert exchange of `plan` (`--moe-overlap`, already resolved)."""
    return overlap_pieces(plan.compute.moe_overlap, plan.mesh) \
        if plan.mesh.shape[ax.EXPERT] > 1 else 1


def price(rows: list[Row], plan, profile, dcn_axes: frozenset) -> \
        list[tuple[Row, float, bool]]:
    """Each row's seconds per step on the link its axes cross: DCN when any of them spans
    hosts, else the ICI link (calibrated per collective kind where `cpu-sim` measured one)."""
    out = []
    for row in rows:
        if not row.count or not row.axes:
            continue
        link = profile.link(row.kind, across_hosts=bool(set(row.axes) & dcn_axes))
        seconds = row.count * transfer_time(row.kind, row.bytes / row.count,
                                            group_size(plan, row.axes), link)
        out.append((row, seconds, hideable(row)))
    return out


def pipeline_bubble(table, remat: str) -> float:
    """Idle share of a pipelined step's time. The executor advances all stages tick by tick
    (each tick ends in the activation/cotangent permutes), so a tick lasts as long as its
    slowest operation: a forward is 1 unit, a backward 2 (twice the forward's FLOPs, read
    from the forward's stash), 4 with `--remat full` (the chunk's forward recomputed from
    its input, and each layer's again inside it); split (zero-bubble), the input gradient
    and the weight gradient 1 each. Unlike the schedule's own `bubble_fraction`, which
    counts ticks as equal, this weighs them."""
    from jdist.parallel.pipeline.schedule import BWD, FWD, WGT

    cost = {FWD: 1.0, BWD: 1.0 if table.split_backward else 2.0 if stashes(remat) else 4.0,
            WGT: 1.0}
    span = sum(max((cost[op.kind] for op in tick if op is not None), default=0.0)
               for tick in table.grid)
    busy = table.micro * table.virtual * (cost[FWD] + cost[BWD]
                                          + cost[WGT] * table.split_backward)
    return 1 - busy / span


def optimizer_seconds(memory: Breakdown, offload_bytes: int, profile) -> float:
    """The update streams state through HBM: read parameters, gradients and moments, write
    parameters and moments; offloaded moments also cross the host link twice."""
    hbm = (memory.params * 2 + memory.grads + memory.optimizer * 2) / (profile.memory_gbps * 1e9)
    return hbm + 2 * offload_bytes / (profile.host_gbps * 1e9)


def bottleneck(compute: float, memory_bound: float, exposed: dict[str, float],
               bubble_s: float) -> str:
    parts = {"compute": compute, "memory-bound (optimizer)": memory_bound,
             "pipeline bubble": bubble_s, **exposed}
    return max(parts, key=parts.get)


def estimate(layout: Layout, plan, memory: Breakdown, rows: list[Row], profile,
             dcn_axes: frozenset, batch_size: int, seq_len: int, attention: str,
             offload_bytes: int = 0, exposure: dict | None = None) -> Estimate:
    """Cost of `layout` whose plan, memory and traffic are already known. `exposure`
    ({(kind, axes): exposed share}, from the GPU-compiled step: `jdist.plan.verify`)
    replaces the assumed overlap: each row hides what the compiled schedule hides."""
    shape = layout.shape
    stages = shape[ax.STAGE]
    devices = math.prod(shape.values())
    tokens_per_stage_group = batch_size * seq_len / (devices / stages)
    pieces = moe_pieces(plan)
    experts = expert_factor(plan.model, tokens_per_stage_group / plan.compute.grad_accum,
                            shape.get(ax.EXPERT, 1), pieces)
    flops = executed_flops(plan.model, seq_len, tokens_per_stage_group, attention,
                           plan.compute.remat, stages > 1, plan.compute.loss, stages, experts) \
        + newton_schulz_per_device(plan.abstract.opt_state, plan.opt_device_shardings,
                                   dict(plan.mesh.shape), plan.names)
    # `--fp8`: the projections' share at the profile's FP8 rate.
    fast = fp8_flops(plan.model, tokens_per_stage_group, plan.compute.remat, stages > 1, stages,
                     experts) if plan.compute.fp8 != "off" else 0.0
    compute = (flops - fast + fast / profile.fp8_rate) / profile.achievable_flops
    comm = price(rows, plan, profile, dcn_axes)
    # Each class hides its overlap fraction, the two together never more than the compute;
    # the expert exchanges by their pieces where the GPU scheduler overlaps them.
    gpu = overlap_by_default(plan.mesh)
    hiding = pieces if pieces_hide(plan.model, shape) else 1
    wanted = {True: profile.overlap, False: profile.overlap_tensor}
    hidden = [1 - exposure.get((row.kind, row.axes), 1.0) if exposure is not None
              else 1 - exposed_share(hiding) if gpu and expert_exchange(row, plan)
              else wanted[h] for row, _, h in comm]
    hide = sum(s * f for (_, s, _), f in zip(comm, hidden))
    scale = min(1.0, compute / hide) if hide else 0.0
    hidden = tuple(f * scale for f in hidden)
    exposed_rows: dict[str, float] = {}
    for (row, s, _), f in zip(comm, hidden):
        name = f"{row.kind} over {','.join(row.axes)}"
        exposed_rows[name] = exposed_rows.get(name, 0.0) + s * (1 - f)
    exposed = sum(exposed_rows.values())
    bubble = pipeline_bubble(plan.pipeline.table(stages), plan.compute.remat) \
        if plan.pipeline else 0.0
    busy = compute + exposed
    stretched = busy if profile.shared_cores else busy / (1 - bubble)
    memory_bound = optimizer_seconds(memory, offload_bytes, profile)
    step = stretched + memory_bound + profile.step_overhead_ms * 1e-3
    tokens = batch_size * seq_len
    mfu = model_flops(plan.model, seq_len, tokens) / step / devices / (profile.peak_tflops * 1e12)
    return Estimate(layout, memory, flops, compute, memory_bound, comm, bubble, step,
                    tokens / step, mfu, bottleneck(compute, memory_bound, exposed_rows,
                                                   stretched - busy), hidden)
