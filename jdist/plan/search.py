"""The search: every layout of `jdist.plan.layouts` on N devices, pruned with the trainer's
own checks (`plan_for`) and memory model, costed (`jdist.plan.cost`) and ranked.

Per mesh shape and choice of ZeRO stage, sequence-parallel, context-parallel strategy and
pipeline schedule, the trainer plans the layout once; remat policies, attention kernels,
`--moe-overlap` where experts split over devices, and gradient accumulation are then
varied on that plan (they change no sharding), the
smallest accumulation that fits is kept for each, and the fastest fitting variant stands
for the group. Optimizer offload is tried only where nothing else fits: it is never faster.

A tensor-parallel layout without sequence parallelism is left out where the same layout
with it runs collective matmuls (`jdist.parallel.collective_matmul`, GPUs): that one moves
the same activation bytes beside its matmuls, where Megatron's whole all-reduces wait for
them (a third as many bytes exposed on the GPU compiler:
docs/measurements.md#tensor-collectives), and keeps less, so it is at least as fast
wherever the other fits.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from jdist.errors import ConfigError
from jdist.memory import predict
from jdist.parallel import collective_matmul
from jdist.parallel.pipeline import stashes
from jdist.parallel.pipeline.schedule import SPLIT_BACKWARD
from jdist.plan import cost
from jdist.plan.layouts import REMATS, Layout, divisors, mesh_variants, meshes
from jdist.plan.traffic import step_traffic
from jdist.spmd import axes as ax
from jdist.spmd.mesh import dcn_sizes
from jdist.spmd.rules import batch_split

# A layout fits when its predicted total is within this share of what a process may allocate
# on a device: the rest is left to the allocator's fragmentation and the runtime's buffers.
HEADROOM = 0.95
# "Nothing fits" suggests up to this many times the devices (the planner simulates them).
GROWTH = 4


@dataclasses.dataclass
class Result:
    ranked: list[cost.Estimate]              # fitting layouts, fastest first
    considered: int = 0                      # layouts planned
    pruned: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dominated: int = 0                       # left out for their sequence-parallel twin
    smallest: tuple[int, Layout] | None = None  # least memory of the layouts that do not fit


def state_lower_bound(model, shape: dict[str, int], zero: int) -> float:
    """Bytes per device of float32 weights, gradients and Adam moments if every parameter
    split over every axis that may shard it: no layout of this mesh needs less."""
    n = model.n_params()
    split = shape[ax.FSDP] * shape[ax.TENSOR] * shape[ax.STAGE] * shape[ax.EXPERT]
    dp = shape[ax.DATA]
    return 4 * n / split + 4 * n / (split * (dp if zero >= 2 else 1)) + \
        8 * n / (split * (dp if zero >= 1 else 1))


def attentions(plan, seq_len: int) -> list[str]:
    """`auto`, and the kernel it does not pick here (dense `xla` or blockwise `flash`) when
    the trainer accepts it for this layout."""
    from jdist.step.forward import attention_of

    other = "xla" if attention_of(plan, seq_len) != "xla" else "flash"
    try:
        attention_of(plan.computing(attention=other), seq_len)
    except ConfigError:
        return ["auto"]
    return ["auto", other]


def moe_overlaps(plan) -> list[str]:
    """`--moe-overlap` settings to try, what `auto` resolved to first: on and off where
    experts are split over devices (the pieces hide exchanges but keep more and run more
    blocked rows: `cost.moe_pieces`), else the plan's own."""
    if not plan.model.n_experts or plan.mesh.shape[ax.EXPERT] == 1:
        return [plan.compute.moe_overlap]
    return sorted(("on", "off"), key=lambda s: s != plan.compute.moe_overlap)


def accumulations(per_replica: int, pipelined: bool) -> list[int]:
    """Gradient accumulation steps to try, smallest first (pipelines accumulate over their
    micro-batches instead)."""
    return [1] if pipelined else divisors(per_replica)


def search(base, n_devices: int, hosts: int, profile, fixed: dict[str, int] | None = None,
           budget: float | None = None, progress=None) -> Result:
    """Every fitting layout of `base` (a TrainConfig: model, batch, sequence, dtype,
    fine-tuning) on `n_devices` devices over `hosts` hosts, ranked by predicted step time.
    `progress(n, m, result)` hears after each of the m mesh shapes."""
    from jdist.step.from_flags import model_of

    fixed = fixed or {}
    if base.devices.target:  # compile-only devices of the target GPU, laid over the hosts
        base = base.replace(hosts=hosts)
    budget = budget if budget is not None else profile.usable_memory_bytes * HEADROOM
    model = model_of(base)
    result = Result([])
    per_host = n_devices // hosts
    shapes = list(meshes(n_devices, bool(model.n_experts), fixed, max_tensor=per_host))
    for i, shape in enumerate(shapes):
        if progress is not None:
            progress(i, len(shapes), result)
        try:
            dcn = dcn_sizes(shape, {}, hosts)
        except ConfigError:
            result.pruned["axes do not split over the hosts"] += 1
            continue
        dcn_axes = crossing(dcn)
        groups: dict[tuple, list[Layout]] = {}
        for layout in mesh_variants(shape, base.data.batch_size, model.n_layers):
            groups.setdefault((layout.zero, layout.sequence_parallel), []).append(layout)
        hidden_sp = set()  # ZeRO stages whose sequence-parallel layouts fit with collective matmuls
        for (zero, sp), layouts in sorted(groups.items(), key=lambda g: not g[0][1]):  # SP first
            if not sp and zero in hidden_sp:
                result.dominated += len(layouts)
                continue
            if not model.lora and state_lower_bound(model, shape, zero) > budget:
                result.pruned["state cannot fit"] += len(layouts)
                continue
            plan = _search_group(base, layouts, profile, dcn_axes, budget, result)
            if plan is None:  # offloading the optimizer is never faster: only when nothing fits
                plan = _search_group(base, [dataclasses.replace(lay, offload=True)
                                            for lay in layouts], profile, dcn_axes, budget, result)
            if sp and plan is not None and collective_matmul.applies(
                    plan.compute.collective_matmul, plan.mesh, plan.rules,
                    plan.pipeline is not None):
                hidden_sp.add(zero)
    result.ranked.sort(key=lambda e: (e.step_s, e.memory.total, len(e.layout.flags())))
    return result


def crossing(dcn: dict[str, int]) -> frozenset:
    """The mesh axes that span hosts, from `jdist.spmd.mesh.dcn_sizes`."""
    return frozenset(a for a, n in dcn.items() if n > 1)


def _search_group(base, layouts: list[Layout], profile, dcn_axes, budget: float,
                  result: Result):
    """Layouts that share their state's layout (mesh, ZeRO, rules, offload): the trainer
    plans the first, the others vary its schedule (`with_compute`, the trainer's checks).
    Appends the best variant of each to `result`; the plan of one that fits, or None."""
    from jdist.memory import state_bytes
    from jdist.step.from_flags import plan_for, with_compute

    plan, state, found = None, None, None
    for layout in layouts:
        config = layout.to_config(base)
        try:
            if plan is None:
                _, plan, _ = plan_for(config)
                state = state_bytes(plan)
                variant = plan
            else:
                variant = with_compute(plan, config)
        except ConfigError as e:
            result.pruned[str(e).split(";")[0][:60]] += 1
            continue
        result.considered += 1
        best = _best_variant(base, layout, variant, state, profile, dcn_axes, budget, result)
        if best is not None:
            result.ranked.append(best)
            found = variant
    return found


def _best_variant(base, layout: Layout, plan, state, profile, dcn_axes, budget: float,
                  result: Result) -> cost.Estimate | None:
    """The fastest fitting (remat, attention, accumulation) of one planned layout."""
    shape = layout.shape
    replicas = batch_split(shape, plan.rules)[1]
    best = None
    for remat, overlap in itertools.product(REMATS, moe_overlaps(plan)):
        if plan.pipeline and plan.pipeline.schedule in SPLIT_BACKWARD and not stashes(remat):
            continue  # a split backward reads a stash (`pipeline.check_remat`)
        for attention in attentions(plan, base.data.seq_len):
            for accum in accumulations(base.data.batch_size // replicas, plan.pipeline is not None):
                variant = plan.computing(remat=remat, grad_accum=accum, attention=attention,
                                         moe_overlap=overlap)
                memory = predict(variant, base.data.batch_size // accum, base.data.seq_len, state)
                chosen = dataclasses.replace(
                    layout, remat=remat, grad_accum=accum, attention=attention,
                    moe_overlap="auto" if overlap == plan.compute.moe_overlap else overlap)
                if memory.total > budget:
                    if result.smallest is None or memory.total < result.smallest[0]:
                        result.smallest = (memory.total, chosen)
                    continue
                est = _estimate(chosen, variant, memory, profile, dcn_axes, base)
                if best is None or est.step_s < best.step_s:
                    best = est
                break  # more accumulation only adds per-micro-batch gathers
    return best


def _estimate(layout: Layout, plan, memory, profile, dcn_axes, base,
              exposure: dict | None = None) -> cost.Estimate:
    from jdist.step.forward import attention_of

    offload = 0
    if layout.offload:
        from jdist.spmd.sharding import per_device_bytes
        offload = per_device_bytes(plan.abstract.opt_state, plan.opt_device_shardings)
    batch_size, seq_len = base.data.batch_size, base.data.seq_len
    rows = step_traffic(plan, batch_size, seq_len)
    return cost.estimate(layout, plan, memory, rows, profile, dcn_axes, batch_size, seq_len,
                         attention_of(plan, seq_len), offload, exposure)


def devices_needed(base, n_devices: int, hosts: int, profile) -> tuple[int, int] | None:
    """(devices, hosts) for the smallest multiple of `n_devices` (up to GROWTH x) on which
    something fits; hosts filled to the profile's devices per host."""
    per_host = max(n_devices // hosts, profile.devices_per_host)
    for k in (2, GROWTH):
        more = n_devices * k
        more_hosts = max(hosts, -(-more // per_host))
        if more % more_hosts == 0 and search(base, more, more_hosts, profile).ranked:
            return more, more_hosts
    return None


def smallest_change(base, n_devices: int, hosts: int, profile) -> list[str]:
    """Changes that would make something fit: more devices, a shorter sequence, QLoRA."""
    out = []
    more = devices_needed(base, n_devices, hosts, profile)
    if more:
        out.append(f"--devices {more[0]} --hosts {more[1]}")
    seq = base.data.seq_len // 2
    while seq >= 128:
        if search(base.replace(seq_len=seq), n_devices, hosts, profile).ranked:
            out.append(f"--seq-len {seq}")
            break
        seq //= 2
    if base.finetune.lora_rank is None:
        qlora = base.replace(lora_rank=16, quantize_base="nf4", double_quant=True,
                                    compute_dtype="bfloat16")
        if search(qlora, n_devices, hosts, profile).ranked:
            out.append("QLoRA (--lora-rank 16 --quantize-base nf4 --double-quant)")
    return out


def describe_counts(result: Result) -> str:
    pruned = sum(result.pruned.values())
    twins = f", {result.dominated} left for their sequence-parallel twin" \
        if result.dominated else ""
    return (f"{result.considered + pruned + result.dominated} layouts: {result.considered} "
            f"planned, {pruned} refused by the trainer's checks{twins}, "
            f"{len(result.ranked)} fit")
