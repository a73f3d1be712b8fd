"""The layouts a model can train with on N devices: every degree of every mesh axis, ZeRO
stage, remat policy, context-parallel strategy, pipeline schedule and attention kernel, as
the `python -m jdist.train` flags that select them.

A `Layout` is plain values; `to_config` turns it into the trainer's own `TrainConfig`, so
the planner prunes with exactly the checks a run makes (`jdist.step.from_flags.plan_for`).
Enumeration is a product of independent choices, with two rules that only drop layouts
equal to another one: ZeRO-3 on `data` is left out (`dp=N --zero 3` lays state out and
communicates as `fsdp=N` does, which is enumerated), and the choices that only exist on
some axis (sequence-parallel with tp, strategies with sp, schedules with pp) appear there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from jdist.parallel.pipeline import schedule as sched
from jdist.spmd import axes as ax
from jdist.spmd.mesh import mesh_text
from jdist.spmd.rules import batch_split

CP_STRATEGIES = ("ring", "all_gather", "ulysses")
REMATS = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a step: axis sizes (canonical names, all six), and the flags."""

    sizes: tuple[tuple[str, int], ...]
    zero: int = 0
    remat: str = "none"
    grad_accum: int = 1
    sequence_parallel: bool = False
    cp_strategy: str = "ring"
    pp_schedule: str = sched.ONE_F_ONE_B
    microbatches: int = 0
    virtual: int = 1
    attention: str = "auto"
    offload: bool = False
    moe_overlap: str = "auto"  # `--moe-overlap`: auto unless the search chose otherwise

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.sizes)

    def mesh_text(self) -> str:
        return mesh_text(dict(self.sizes))

    def flags(self) -> list[str]:
        """The `python -m jdist.train` flags of this layout (defaults left out)."""
        s = self.shape
        out = ["--mesh", self.mesh_text()]
        if self.zero:
            out += ["--zero", str(self.zero)]
        if self.remat != "none":
            out += ["--remat", self.remat]
        if self.grad_accum > 1:
            out += ["--grad-accum", str(self.grad_accum)]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if s[ax.SEQUENCE] > 1 and self.cp_strategy != "ring":
            out += ["--cp-strategy", self.cp_strategy]
        if s[ax.STAGE] > 1:
            if self.pp_schedule != sched.ONE_F_ONE_B:
                out += ["--pp-schedule", self.pp_schedule]
            if self.virtual > 1 and self.pp_schedule not in sched.V_SHAPED:
                out += ["--pp-virtual-stages", str(self.virtual)]
            if self.microbatches:
                out += ["--microbatches", str(self.microbatches)]
        if self.attention != "auto":
            out += ["--attention", self.attention]
        if self.offload:
            out += ["--offload", "optimizer"]
        if self.moe_overlap != "auto":
            out += ["--moe-overlap", self.moe_overlap]
        return out

    def label(self) -> str:
        """A short table cell: the mesh and the non-default flags."""
        return " ".join([self.mesh_text()] + self.flags()[2:])

    def to_config(self, base):
        """`base` (a TrainConfig with model, batch, sequence and fine-tuning flags) run
        with this layout."""
        return base.replace(
            mesh=self.mesh_text(), zero=self.zero, remat=self.remat,
            grad_accum=self.grad_accum, sequence_parallel=self.sequence_parallel,
            cp_strategy=self.cp_strategy, pp_schedule=self.pp_schedule,
            microbatches=self.microbatches, pp_virtual_stages=self.virtual,
            attention=self.attention, offload="optimizer" if self.offload else "none",
            moe_overlap=self.moe_overlap,
            cpu_devices=math.prod(self.shape.values()))


def factorizations(n: int, axes: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """Every assignment of sizes to `axes` whose product is n."""
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, axes[1:]):
                yield {axes[0]: d, **rest}


def meshes(n_devices: int, moe: bool, fixed: dict[str, int], max_tensor: int) -> \
        Iterator[dict[str, int]]:
    """Axis sizes over all six axes: `fixed` ones as given, expert only for MoE models,
    tensor at most `max_tensor` (its all-reduces sit on the critical path of every layer,
    so it never leaves a host)."""
    free = tuple(a for a in ax.MESH_AXES if a not in fixed and (moe or a != ax.EXPERT))
    left = n_devices // math.prod(fixed.values())
    for sizes in factorizations(left, free):
        shape = {a: 1 for a in ax.MESH_AXES} | sizes | fixed
        if shape[ax.TENSOR] <= max_tensor:
            yield shape


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipelines(stages: int, per_replica: int, n_layers: int) -> Iterator[tuple[str, int, int]]:
    """(schedule, micro-batches, virtual stages) for `stages` stages when each batch
    replica holds `per_replica` sequences: 1f1b and zb-h1 with M in {P, 2P, 4P, ...} up to
    one sequence per micro-batch, and interleaved and zbv (two chunks per stage) when the
    layers split. GPipe is
    left out: its bubble is 1F1B's at equal M and it stashes all M micro-batches, not
    about P."""
    if stages == 1:
        yield sched.ONE_F_ONE_B, 0, 1
        return
    m = stages
    while m <= per_replica:
        if per_replica % m == 0:
            yield sched.ONE_F_ONE_B, m, 1
            yield sched.ZB_H1, m, 1
            if n_layers % (2 * stages) == 0:
                yield sched.INTERLEAVED, m, 2
                yield sched.ZB_V, m, 2
        m *= 2


def mesh_variants(shape: dict[str, int], batch_size: int, n_layers: int) -> Iterator[Layout]:
    """Every layout on one mesh shape with remat none, attention auto and no accumulation:
    the search varies those on each one's plan (`jdist.plan.search`)."""
    sizes = tuple((a, shape[a]) for a in ax.MESH_AXES)
    replicas = batch_split(shape)[1]
    if batch_size % replicas:
        return
    zeros = (0, 1, 2) if shape[ax.DATA] > 1 else (0,)
    sps = (False, True) if shape[ax.TENSOR] > 1 else (False,)
    cps = CP_STRATEGIES if shape[ax.SEQUENCE] > 1 else ("ring",)
    for zero in zeros:
        for sp in sps:
            for cp in cps:
                for schedule, micro, virtual in pipelines(
                        shape[ax.STAGE], batch_size // replicas, n_layers):
                    yield Layout(sizes, zero, "none", 1, sp, cp, schedule, micro, virtual)
