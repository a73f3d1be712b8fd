"""What a scheduled GPU program says about a step: collective bytes, how many of them are
exposed, and the FLOPs it executes.

Read from the text of a step compiled for a GPU (`jdist.runtime.target`), whose instructions print
in the order XLA's latency-hiding scheduler runs them. Per device and per step:

- **Collective bytes** by kind and mesh axes, each collective weighted by how often a step
  runs it (the trip counts of the loops around it, multiplied). A pipeline tick's
  `lax.switch` (idle, forward, backward) weighs each branch by the share of ticks the
  schedule table gives it on a device (`branch_shares`); any other conditional gives each
  of its n branches 1/n of its executions (which branch runs is data).
- **Exposed communication**: an asynchronous collective is *hidden* when at least one
  matmul-class operation (a cuBLAS gemm, a Triton or custom gemm fusion, a cuDNN call, or a
  loop or call holding one) is scheduled between its `-start` and its `-done` on the same
  stream of instructions; otherwise it is *exposed*, and so is every synchronous collective.
  The exposed share is exposed bytes over all bytes. A matmul in the window is necessary
  for overlap, not sufficient: a small gemm beside a large all-gather hides little of it.
  It is a deterministic proxy for the overlap a profile would measure, not a timing.
- **Executed FLOPs**: the matmuls' FLOPs as compiled (2 x output elements x contracted
  size for each gemm and dot; cuDNN attention as its two forward / five backward batched
  matmuls over the score matrix, half of it under a causal mask, the window's pairs under
  a sliding window, whose masked tiles cuDNN skips), weighted like the bytes. Remat and
  pipeline recompute show up here and not in the model FLOPs (`jdist.tools.throughput`,
  PaLM's convention). Elementwise work is not counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from jdist.tools import comm, hlo
from jdist.tools.comm import axes_of

# Custom calls that are matmuls (cuBLAS, cuBLASLt) or run on the tensor cores (cuDNN).
MATMUL_CALLS = ("__cublas$", "__cudnn$")
_CALLED = re.compile(r"(?:calls|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# A Pallas Triton kernel that says its matmul FLOPs in its metadata (`models.grouped_kernel`):
# the call's shapes do not tell them. Its quotes print escaped (\22) in the HLO text.
_KERNEL_FLOPS = re.compile(r'matmul_flops(?:\\22|\\"|")[:\s]*(?:\\22|\\"|")(\d+)')


@dataclasses.dataclass
class Row(comm.Row):
    """`jdist.tools.comm.Row` (no predicted seconds here) with the bytes left exposed."""

    exposed_bytes: int = 0

    @property
    def exposed(self) -> float:
        return self.exposed_bytes / self.bytes if self.bytes else 0.0


@dataclasses.dataclass
class GpuReport:
    rows: list[Row]
    executed_flops: float  # per device per step
    model_flops: float     # per device per step (PaLM's convention), 0 if not given
    gemms: float = 0.0     # gemm executions per step (dots and cuBLAS calls; not attention)
    fp8_gemms: float = 0.0  # of which on float8 operands (`--fp8`, jdist.quant.fp8)
    fp8_flops: float = 0.0  # their FLOPs

    def total(self) -> Row:
        return Row("total", (), sum(r.count for r in self.rows),
                   sum(r.bytes for r in self.rows),
                   exposed_bytes=sum(r.exposed_bytes for r in self.rows))

    @property
    def exposed(self) -> float:
        return self.total().exposed

    def as_dict(self) -> dict:
        row = lambda r: {"kind": r.kind, "axes": list(r.axes), "count": r.count,
                         "bytes": r.bytes, "exposed_bytes": r.exposed_bytes,
                         "exposed": r.exposed}
        return {"rows": [row(r) for r in self.rows], "total": row(self.total()),
                "executed_flops": self.executed_flops, "model_flops": self.model_flops,
                "gemms": self.gemms, "fp8_gemms": self.fp8_gemms, "fp8_flops": self.fp8_flops}


def matmul_computations(computations: dict[str, str]) -> set[str]:
    """Names of the computations that hold a matmul-class operation, directly or in a
    computation they call (fusions, loops, branches)."""
    calls = {name: _callees(text) for name, text in computations.items()}
    heavy = {name for name, text in computations.items()
             if any(_own_matmul(i) for i in hlo.instructions(text))}
    grew = True
    while grew:
        more = {name for name, callees in calls.items() if name not in heavy and callees & heavy}
        heavy |= more
        grew = bool(more)
    return heavy


def _callees(text: str) -> set[str]:
    out = set()
    for single, branches in _CALLED.findall(text):
        out |= {single} if single else {b.strip().lstrip("%") for b in branches.split(",")}
    return out - {""}


def _own_matmul(i: hlo.Instruction) -> bool:
    if i.op in ("dot", "convolution"):
        return True
    target = _TARGET.search(i.rest) if i.op == "custom-call" else None
    return bool(target) and target.group(1).startswith(MATMUL_CALLS) or _kernel_gemm(i)


def _kernel_gemm(i: hlo.Instruction) -> bool:
    return i.op == "custom-call" and bool(_KERNEL_FLOPS.search(i.rest))


def is_matmul(i: hlo.Instruction, heavy: set[str]) -> bool:
    """`i` is, or runs (a fusion, loop, call or branch holding one), a matmul."""
    return _own_matmul(i) or bool(_callees(i.rest) & heavy)


def report(hlo_text: str, mesh, model_flops: float = 0.0,
           branch_shares: dict[int, tuple[float, ...]] | None = None,
           unknown_trips: float = 1.0, only=None) -> GpuReport:
    """The report of scheduled GPU HLO text on `mesh` (module docstring); loops whose trip
    count depends on data run `unknown_trips` times (the MoE's extra rounds: 0 when routing
    is near balance). `only(attributes)`: count only the collectives whose attributes'
    text (op name and all) it accepts."""
    comps = hlo.computations(hlo_text)
    heavy = matmul_computations(comps)
    runs = executions(hlo_text, comps, branch_shares, unknown_trips)
    types = {i.name: i.type for text in comps.values() for i in hlo.instructions(text)}
    rows: dict[tuple[str, tuple[str, ...]], Row] = {}
    flops = gemms = fp8_gemms = fp8_flops = 0.0
    for name, text in comps.items():
        body = hlo.instructions(text)
        times = runs.get(name, 0)
        flops += times * sum(_flops(i, types) for i in body)
        for i in filter(_gemm, body):
            gemms += times
            if _fp8(i, types):
                fp8_gemms += times
                fp8_flops += times * _flops(i, types)
        for kind, nbytes, rest, exposed in _collectives(body, heavy):
            if only is not None and not only(rest):
                continue
            groups = hlo.device_groups(rest, mesh.devices.size)
            axes = axes_of(groups, mesh)
            row = rows.setdefault((kind, axes), Row(kind, axes))
            row.count += times
            row.bytes += times * nbytes
            row.exposed_bytes += times * nbytes * exposed
    order = {kind: i for i, kind in enumerate(hlo.COLLECTIVES)}
    return GpuReport(sorted(rows.values(), key=lambda r: (order[r.kind], r.axes)), flops,
                     model_flops, gemms, fp8_gemms, fp8_flops)


def _gemm(i: hlo.Instruction) -> bool:
    """A gemm: a dot (alone or in a Triton gemm fusion), a cuBLAS call or a matmul kernel."""
    target = _TARGET.search(i.rest) if i.op == "custom-call" else None
    return i.op == "dot" or bool(target) and target.group(1).startswith("__cublas$") \
        or _kernel_gemm(i)


def _fp8(i: hlo.Instruction, types: dict[str, str]) -> bool:
    """A gemm on float8 operands: a dot of float8 values (XLA's Triton FP8 gemm) or
    cuBLASLt's FP8 gemm (`__cublas$lt$matmul$f8`)."""
    if i.op == "dot":
        return any(types.get(o, "").startswith("f8") for o in _operands(i.rest)[:2])
    target = _TARGET.search(i.rest)
    return bool(target) and "f8" in target.group(1)


def _collectives(body: list[hlo.Instruction], heavy: set[str]):
    """(kind, result bytes, attributes, exposed) of each collective of one computation."""
    position = {i.name: n for n, i in enumerate(body)}
    done_of = hlo.dones(body)
    for i in body:
        kind = i.op.removesuffix("-start")
        if kind not in hlo.COLLECTIVES:
            continue
        if not i.op.endswith("-start"):  # synchronous: nothing runs beside it
            yield kind, hlo.type_bytes(i.type), i.rest, True
            continue
        end = done_of.get(i.name)
        # A start whose done is elsewhere (pipelined across a loop's iterations) overlaps
        # the rest of this computation.
        window = body[position[i.name] + 1: end if end is not None else len(body)]
        result = body[end].type if end is not None else hlo.start_result(kind, i.type)
        yield kind, hlo.type_bytes(result), i.rest, not any(is_matmul(w, heavy)
                                                             for w in window)


def executions(hlo_text: str, comps: dict[str, str] | None = None,
               branch_shares: dict[int, tuple[float, ...]] | None = None,
               unknown_trips: float = 1.0) -> dict[str, float]:
    """{computation: executions per run} along the whole call graph: a loop body once per
    iteration (`known_trip_count`, else `unknown_trips` times), a fusion or call as often
    as its caller, the branches of a conditional with n branches by `branch_shares[n]`
    (shares in branch order) of its caller's, else 1/n each (which branch runs is data).
    Reducers (`to_apply`) are not counted: they hold no matmul or collective."""
    comps = comps or hlo.computations(hlo_text)
    times = dict.fromkeys(comps, 0.0)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo_text, re.MULTILINE)
    times[entry.group(1) if entry else list(comps)[-1]] = 1.0
    for name in reversed(list(comps)):  # XLA prints callees first: walk callers first
        for line in comps[name].splitlines():
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            for key, callee in re.findall(r"(calls|body)=%?([\w.\-]+)", line):
                n = 1 if key != "body" else int(trips.group(1)) if trips else unknown_trips
                if callee in times:
                    times[callee] += times[name] * n
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            # A predicate's conditional (XLA GPU rewrites two-way `lax.cond`s so) lists
            # true first; in branch-index order false is branch 0.
            pred = re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)",
                             line)
            names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] \
                if branches else [pred.group(2), pred.group(1)] if pred else []
            if names:
                shares = (branch_shares or {}).get(len(names)) or [1 / len(names)] * len(names)
                for b, share in zip(names, shares):
                    if b in times:
                        times[b] += times[name] * share
    return times


def _dims(type_text: str) -> list[list[int]]:
    return [[int(d) for d in filter(None, dims.split(","))]
            for _, dims in hlo._SHAPE.findall(type_text)]


def _operands(rest: str) -> list[str]:
    head = rest.split(")")[0]
    return [o.strip().lstrip("%") for o in head.split(",") if o.strip()]


def _flops(i: hlo.Instruction, types: dict[str, str]) -> float:
    """Matmul FLOPs of one instruction (0 for anything else)."""
    if i.op == "dot":
        lhs = _dims(types.get(_operands(i.rest)[0], ""))
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.rest)
        if not lhs or not contracting:
            return 0.0
        k = math.prod(lhs[0][int(d)] for d in filter(None, contracting.group(1).split(",")))
        return 2.0 * math.prod(_dims(i.type)[0]) * k
    if i.op != "custom-call":
        return 0.0
    if kernel := _KERNEL_FLOPS.search(i.rest):
        return float(kernel.group(1))
    target = _TARGET.search(i.rest)
    name = target.group(1) if target else ""
    config = _backend_config(i.rest)
    if name.startswith("__cublas$"):
        numbers = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        lhs = _dims(types.get(_operands(i.rest)[0], ""))
        if not lhs:
            return 0.0
        k = math.prod(lhs[0][int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
        return 2.0 * math.prod(_dims(i.type)[0]) * k
    if name.startswith("__cudnn$fmha"):
        fmha = config.get("cudnn_fmha_backend_config", {})
        scores = math.prod(int(d) for d in fmha.get("intermediate_tensor_shape", {})
                           .get("dimensions", []))
        head_dim = _dims(i.type)[0][-1]
        matmuls = 5 if "Backward" in name else 2
        return 2.0 * matmuls * scores * head_dim * _cudnn_share(fmha)
    return 0.0


def _cudnn_share(fmha: dict) -> float:
    """The share of the score matrix a cuDNN attention call computes: all of it, half under
    a causal mask, and under a sliding window of W keys the W * T - W (W - 1) / 2 pairs of
    the T x T scores it keeps."""
    if fmha.get("mask_type") != "CAUSAL":
        return 1.0
    t = int(fmha.get("intermediate_tensor_shape", {}).get("dimensions", ["1"])[-1])
    w = int(fmha.get("sliding_window_length", 0))
    return 0.5 if not 0 < w < t else (w * t - w * (w - 1) / 2) / (t * t)


def _backend_config(rest: str) -> dict:
    at = rest.find("backend_config=")
    if at < 0:
        return {}
    try:
        return json.JSONDecoder().raw_decode(rest[at + len("backend_config="):])[0]
    except ValueError:
        return {}


def table(rep: GpuReport) -> str:
    """One line per collective kind and mesh axes: executions, MiB and the exposed share
    per step per device; then the total and the executed against the model FLOPs."""
    lines = ["GPU program: communication per step, per device (exposed: no matmul scheduled "
             "between start and done)",
             f"{'collective':20} {'mesh axes':22} {'count':>7} {'MiB':>12} {'exposed':>8}"]
    for r in (*rep.rows, rep.total()):
        axes = ",".join(r.axes) or ("-" if r.kind != "total" else "")
        lines.append(f"{r.kind:20} {axes:22} {r.count:7.0f} {r.bytes / 2**20:12.3f} "
                     f"{r.exposed:8.1%}")
    line = f"executed matmul FLOPs per device: {rep.executed_flops / 1e12:.4g} TFLOP"
    if rep.model_flops:
        line += (f" (model FLOPs {rep.model_flops / 1e12:.4g} TFLOP, executed/model "
                 f"{rep.executed_flops / rep.model_flops:.3f})")
    gemms = (f"gemms per step: {rep.gemms:.0f}, {rep.fp8_gemms:.0f} on float8 operands "
             f"({rep.fp8_flops / 1e12:.4g} TFLOP)")
    return "\n".join([*lines, line, gemms])


def step_report(compiled, plan, batch_size: int, seq_len: int) -> GpuReport:
    """The report of a training step compiled for a GPU target, with the model FLOPs of
    its global batch per device."""
    from jdist.tools.throughput import flops_per_token

    model = flops_per_token(plan.model, seq_len) * batch_size * seq_len / plan.mesh.devices.size
    return report(compiled.as_text(), plan.mesh, model, pipeline_shares(plan))


def pipeline_shares(plan) -> dict[int, tuple[float, ...]] | None:
    """{3: (idle, forward, backward)}, or {4: (..., weight gradient)} where backwards are
    split: the share of a pipelined step's ticks each operation takes on a device
    (`jdist.parallel.pipeline.program` switches on them in that order; every stage runs as
    many of each); {2: (otherwise, then)}: a chunk's
    `lax.cond`s (`jdist.step.forward.chunk`: embed if first, score if last) take their
    branch on one chunk in C = P x V, so on a device on average 1/C of the time (the step's
    only two-way conditionals; the ring's causal dispatch is a three-way switch)."""
    from jdist.parallel.pipeline.schedule import BWD, FWD, IDLE, WGT

    if plan.pipeline is None:
        return None
    table = plan.pipeline.table(plan.mesh.shape["stage"])
    kinds = [row[0].kind if row[0] is not None else IDLE for row in table.grid]
    ops = (IDLE, FWD, BWD, WGT) if table.split_backward else (IDLE, FWD, BWD)
    return {len(ops): tuple(kinds.count(k) / len(kinds) for k in ops),
            2: (1 - 1 / table.chunks, 1 / table.chunks)}
