"""The collectives of one training step, predicted from the plan without compiling anything.

`step_traffic(plan, batch_size, seq_len)` returns what `jdist.tools.comm.report` reads from the
compiled step's HLO: one `jdist.tools.comm.Row` per collective kind and tuple of mesh axes, with
executions and bytes per device per step, in the convention of `jdist.tools.hlo` (a collective's
bytes are its result's: an all-reduce's operand, a reduce-scatter's one shard, an
all-gather's the gathered array). It is arithmetic on the plan's shapes and shardings, so a
planner can cost hundreds of layouts of a 70B model in seconds. `collectives` lists the
same traffic item by item (`Collective`: per-execution bytes, dtype and the code that emits
it); `jdist.tools.comm.transfer_time(kind, bytes per execution, group_size(plan, axes), link)`
prices one.

Two kinds of knowledge, kept apart:
- `exact.py`, `kernels.py`: the collectives jdist's own code writes, derived from it: per-
  layer parameter gathers and gradient reductions (`jdist.parallel.grad_sync`), the
  embedding lookup (`jdist.parallel.embedding`), the chunked loss (`jdist.parallel.vocab`),
  the context-parallel kernels (`ring_attention`, `all_gather_attention`,
  `ulysses_attention`), the MoE dispatch (`jdist.parallel.moe`), the loss's psums, the
  pipeline's per-tick permutes and end-of-step sums (`jdist.parallel.pipeline.program`,
  `jdist.step.pipelined`).
- `partitioner.py`: what compiling adds, fitted to jax 0.10.2 on CPU by compiling steps
  and reading `jdist.tools.comm.report`: GSPMD's Megatron tensor-parallel all-reduces, sequence
  parallelism's all-gathers, the ZeRO-1/2 update's all-gathers, partial sums of
  gradients over automatic axes that split the tokens, the collectives around the
  embedding and loss, the gradient norm's scalars; and XLA's and remat's say in how
  often jdist's collectives run.
  tests/test_plan_traffic.py keeps it honest (how closely it matched by hand:
  docs/measurements.md#traffic-model-fit).
`layout.py` reads the step as one device sees it (`Step`, `Leaf`); `step.py` counts every
piece as often as the step runs it.

Conventions:
- dtypes are the program's: parameters gather in the compute dtype (norm scales in float32),
  gradients reduce in float32 (their partial sums over token axes in the dtype of the dot
  that made them), activations move in the compute dtype. The CPU backend upcasts bf16
  collectives to f32 after partitioning, so a CPU report of a bfloat16 step reads what
  `step_traffic` predicts for the same plan in float32 (`jdist.tools.hlo.partitioned` shows the
  program's dtypes, which these are).
- On CPU, GSPMD leaves sequence parallelism's reductions as all-reduces (the CPU backend
  never forms reduce-scatters); a GPU compile may turn each into a reduce-scatter of 1/T
  the bytes. Predicted as on CPU.
- Collectives over groups of one device, which the HLO keeps (a psum over a size-1 replica
  axis), move nothing: they are left out here, and the report's rows with axes () are
  ignored when comparing.
- Pipelines: a stage runs M x V chunk forwards and as many backwards per step; each
  collective inside them counts that often. The first chunk's embedding and the last
  chunk's loss run M times each on their stages: both are counted, as if one device ran
  them. `jdist.tools.comm.report` cannot know how often a `lax.switch` branch runs and counts
  each branch's collectives once; `reported_traffic` predicts that convention.
- `count` is executions per step before XLA's combiners merge small all-reduces into
  tuples (the report counts merged ones): bytes match the report, counts need not.

Not covered (estimates, unchecked against a compile): the tensor-parallel logits of
`--loss full` (their reductions are not modelled), packed documents' segment ids travelling
with the ring, sequence parallelism combined with context parallelism or expert
parallelism outside the layers, QLoRA's NF4 storage, rules other than the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from jdist.plan.traffic.layout import Collective, Leaf, Step, leaves_of, step_of
from jdist.plan.traffic.step import collectives
from jdist.tools.comm import Row
from jdist.tools.hlo import COLLECTIVES

__all__ = ["Collective", "Leaf", "Step", "collectives", "group_size", "leaves_of",
           "reported_traffic", "step_of", "step_traffic", "to_rows"]


def group_size(plan, axes: Iterable[str]) -> int:
    """Devices in each group of a collective over `axes`: the product of their sizes."""
    return math.prod(plan.mesh.shape[a] for a in axes)


def step_traffic(plan, batch_size: int, seq_len: int) -> list[Row]:
    """Collectives of one training step of `plan` (a jdist.step.state.Plan, as
    jdist.step.from_flags.plan_for builds it; pipelined plans have plan.pipeline set) on a global
    batch of batch_size x seq_len tokens: one Row(kind, axes, count, bytes) per collective
    kind and tuple of mesh axes (mesh order, as jdist.tools.comm.axes_of names them), bytes per
    device per step (count x bytes per execution), seconds left 0."""
    return to_rows(collectives(plan, batch_size, seq_len))


def reported_traffic(plan, batch_size: int, seq_len: int) -> list[Row]:
    """`step_traffic` as `jdist.tools.comm.report` counts it: a pipeline's collectives inside the
    stage's `lax.switch` branches once per branch. The same as `step_traffic` without
    pipeline stages."""
    return to_rows(collectives(plan, batch_size, seq_len, executed=False))


def to_rows(items: Iterable[Collective]) -> list[Row]:
    """Collectives summed per (kind, axes), in the report's order; empty ones left out."""
    rows: dict[tuple[str, tuple[str, ...]], Row] = {}
    for c in items:
        if c.count and c.elements and c.axes:
            row = rows.setdefault((c.kind, c.axes), Row(c.kind, c.axes))
            row.count += c.count
            row.bytes += c.count * c.bytes
    order = {kind: i for i, kind in enumerate(COLLECTIVES)}
    return sorted(rows.values(), key=lambda r: (order[r.kind], r.axes))
