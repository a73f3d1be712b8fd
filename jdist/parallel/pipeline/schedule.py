"""Pipeline schedules as static tables: which micro-batch each stage runs forward or backward
at each tick, and where every activation waits in between. Pure Python (no JAX).

A schedule is built in two steps. `op_orders` lists, per stage, the order in which the stage
wants to run its forward (F) and backward (B) operations; that order is what distinguishes
GPipe, 1F1B and interleaved. `simulate` then plays the orders against the data dependencies
(F of chunk c needs F of chunk c-1, B of chunk c needs B of chunk c+1), one operation per
stage per tick, a result reaching the neighbour at the end of its tick. The resulting grid is
what the `jax.shard_map` kernel in `jdist.parallel.pipeline` executes, so the bubble printed
by `--pp-show-schedule` and measured by `benchmarks/pipeline.py` is the executed one.

Layers are cut into C = P x V chunks; chunk c lives on stage c % P as its virtual chunk
c // P (V = 1: chunk c is stage c), except in the V shape (ZB-V), where the second chunk
runs back down: stage s holds chunks s and 2P-1-s, so the first stage embeds and takes the
loss, and the last stage passes its first chunk's output to its own second chunk
(`chunk_index`).
"""

from __future__ import annotations

import dataclasses
import functools

from jdist.errors import require

GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZB_V = "gpipe", "1f1b", "interleaved", "zb-h1", "zbv"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZB_V)
# Operation kinds, as the kernel's `lax.switch` indexes them. Zero-bubble schedules split a
# backward in two: BWD pulls the cotangent back to the chunk input only (the critical path),
# WGT computes the weight gradients later, where the stage would otherwise idle.
IDLE, FWD, BWD, WGT = 0, 1, 2, 3
SPLIT_BACKWARD = (ZB_H1, ZB_V)
V_SHAPED = (ZB_V,)  # two chunks per stage, the second run from the last stage back to the first
# Where what a stage receives at the end of a tick comes from: the stage below it (by the
# permute that passes activations on: forwards, and the V's second chunk's backwards), the
# stage above it (the other permute), or itself (the V's turn on the last stage).
BELOW, ABOVE, SELF = 0, 1, 2
SOURCES = (BELOW, ABOVE, SELF)


@dataclasses.dataclass(frozen=True)
class Op:
    kind: int   # FWD or BWD
    micro: int  # micro-batch
    chunk: int  # virtual chunk on its stage (global chunk: `chunk_index`)


def chunk_index(schedule: str, stage: int, v: int, stages: int) -> int:
    """The global chunk (its layers in model order) that virtual chunk v of `stage` runs:
    v * P + stage, or in the V shape 2P-1-stage for the second chunk."""
    if schedule in V_SHAPED and v == 1:
        return 2 * stages - 1 - stage
    return v * stages + stage


def stage_of(schedule: str, c: int, stages: int) -> int:
    """The stage that runs global chunk c."""
    return 2 * stages - 1 - c if schedule in V_SHAPED and c >= stages else c % stages


def virtual_stages(schedule: str, virtual: int) -> int:
    """Chunks per stage a run of `schedule` uses when `--pp-virtual-stages` says `virtual`:
    the V shape always runs two."""
    return 2 if schedule in V_SHAPED and virtual == 1 else virtual


def check(schedule: str, stages: int, micro: int, virtual: int, n_layers: int) -> None:
    """User errors of a pipeline configuration, one line each."""
    require(schedule in SCHEDULES,
            f"unknown pipeline schedule {schedule!r}; use --pp-schedule {'|'.join(SCHEDULES)}")
    require(micro >= 1, f"--microbatches {micro} must be at least 1")
    require(virtual >= 1, f"--pp-virtual-stages {virtual} must be at least 1")
    if schedule == INTERLEAVED:
        require(virtual >= 2, "--pp-schedule interleaved needs --pp-virtual-stages V >= 2 "
                              "(V layer chunks per stage)")
        require(micro % stages == 0,
                f"--pp-schedule interleaved runs micro-batches in groups of pp={stages}; "
                f"change --microbatches {micro} to a multiple of {stages}")
    elif schedule in V_SHAPED:
        require(virtual == 2, f"--pp-schedule {schedule} runs 2 chunks per stage (a V), not "
                              f"--pp-virtual-stages {virtual}; drop --pp-virtual-stages")
    else:
        require(virtual == 1, f"--pp-virtual-stages {virtual} needs --pp-schedule interleaved; "
                              "drop it or switch schedule")
    if schedule in (ONE_F_ONE_B, *SPLIT_BACKWARD):
        require(micro >= stages,
                f"--pp-schedule {schedule} needs at least pp={stages} micro-batches to fill "
                f"the pipeline, got --microbatches {micro}; raise it or use gpipe")
    chunks = stages * virtual
    parts = f"pp={stages} x {virtual} virtual stages = {chunks}" if virtual > 1 else f"pp={stages}"
    require(n_layers % chunks == 0,
            f"{n_layers} layers do not split into {parts} equal chunks; change --n-layers to a "
            f"multiple of {chunks}")


def zero_bubble(schedule: str, stages: int, micro: int) -> list[list[Op | None]]:
    """ZB-H1 and ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2023, and "Pipeline
    Parallelism with Controllable Memory", 2024), played greedily tick by tick. A stage
    runs, in this order of preference: a weight gradient that may wait no longer (more than
    P-1 pending), a backward whose cotangent arrived (ZB-V: the first chunk's, which the
    stage below waits for, before the second's), a forward whose input arrived while the
    stash has room (ZB-V: the second chunk's first, which leads to the loss), else the
    oldest pending weight gradient. The stash's room is 1F1B's: P-s chunk residuals on
    stage s under ZB-H1; under ZB-V 2P half-size chunks on every stage, 1F1B's first stage's
    memory. Deferred weight gradients fill the drain's idle ticks: the bubble is P-1 ticks of
    3VM+P-1 (for M a multiple of P), with a tick per F, B and W of a chunk: ZB-H1's a third
    of 1F1B's, ZB-V's half of ZB-H1's again."""
    vshape = schedule in V_SHAPED
    chunks = (0, 1) if vshape else (0,)
    last = len(chunks) * stages - 1
    room = lambda s: 2 * stages if vshape else stages - s
    done: dict[tuple[int, int, int], int] = {}  # (kind, micro, global chunk) -> tick
    forwards = [[0] * len(chunks) for _ in range(stages)]  # next micro-batch per chunk
    backwards = [[0] * len(chunks) for _ in range(stages)]
    pending: list[list[tuple[int, int]]] = [[] for _ in range(stages)]  # (micro, chunk)
    grid: list[list[Op | None]] = []
    arrived = lambda key, t: done.get(key, t) < t

    def ready(kind: int, m: int, s: int, v: int, t: int) -> bool:
        c = chunk_index(schedule, s, v, stages)
        return m < micro and all(arrived(n, t) for n in _needs(kind, m, c, last))

    def backward(s: int, t: int) -> Op | None:
        return next((Op(BWD, backwards[s][v], v) for v in chunks
                     if ready(BWD, backwards[s][v], s, v, t)), None)

    def forward(s: int, t: int) -> Op | None:
        if sum(forwards[s]) - sum(backwards[s]) >= room(s):
            return None
        return next((Op(FWD, forwards[s][v], v) for v in reversed(chunks)
                     if ready(FWD, forwards[s][v], s, v, t)), None)

    while any(min(backwards[s]) < micro or pending[s] for s in range(stages)):
        t = len(grid)
        row: list[Op | None] = []
        for s in range(stages):
            oldest = Op(WGT, *pending[s][0]) if pending[s] else None
            op = oldest if len(pending[s]) > stages - 1 else None
            row.append(op or backward(s, t) or forward(s, t) or oldest)
        for s, op in enumerate(row):
            if op is None:
                continue
            done[(op.kind, op.micro, chunk_index(schedule, s, op.chunk, stages))] = t
            if op.kind == FWD:
                forwards[s][op.chunk] += 1
            elif op.kind == BWD:
                backwards[s][op.chunk] += 1
                pending[s].append((op.micro, op.chunk))
            else:
                pending[s].pop(0)
        grid.append(row)
    return grid


def op_orders(schedule: str, stages: int, micro: int, virtual: int = 1) -> list[list[Op]]:
    """Per stage, the order in which it runs its operations."""
    if schedule == GPIPE:  # all forwards, then all backwards
        return [[Op(FWD, m, 0) for m in range(micro)] + [Op(BWD, m, 0) for m in range(micro)]
                for _ in range(stages)]
    if schedule == ONE_F_ONE_B:
        # Stage s starts P-s-1 micro-batches ahead, then alternates: a micro-batch's
        # activations are freed by its backward before the next-but-P forward starts.
        return [_one_f_one_b([Op(FWD, m, 0) for m in range(micro)],
                             [Op(BWD, m, 0) for m in range(micro)], min(stages - s - 1, micro))
                for s in range(stages)]
    # Interleaved (Megatron-LM): groups of P micro-batches sweep chunk 0, 1, ..., V-1 forward
    # and V-1, ..., 0 backward; the longer warm-up keeps every chunk's input ready in time.
    per_group = stages * virtual

    def nth(k: int, backward: bool) -> Op:
        v = (k % per_group) // stages
        m = (k // per_group) * stages + k % stages
        return Op(BWD, m, virtual - 1 - v) if backward else Op(FWD, m, v)

    total = micro * virtual
    return [_one_f_one_b([nth(k, False) for k in range(total)],
                         [nth(k, True) for k in range(total)],
                         min(2 * (stages - s - 1) + (virtual - 1) * stages, total))
            for s in range(stages)]


def _one_f_one_b(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    return order + backwards[len(forwards) - warmup:]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The executed grid plus the buffer slots the kernel uses, all indexed [tick][stage].

    `in_slot`: stash slot holding the chunk input an op reads (-1: the first chunk reads
    tokens). `grad_slot`: slot of the output cotangent a backward reads (-1: the last chunk
    starts from the loss). `recv_fwd`/`recv_bwd`, one table per source (`SOURCES`): slot
    where the activation / cotangent arriving from there at the end of the tick is stored
    (-1: nothing arrives)."""

    name: str
    stages: int
    micro: int
    virtual: int
    grid: tuple[tuple[Op | None, ...], ...]
    in_slot: tuple[tuple[int, ...], ...]
    grad_slot: tuple[tuple[int, ...], ...]
    recv_fwd: tuple[tuple[tuple[int, ...], ...], ...]  # [source][tick][stage]
    recv_bwd: tuple[tuple[tuple[int, ...], ...], ...]
    n_slots: int       # stashed chunk inputs per stage: the activation memory of the schedule
    n_grad_slots: int  # cotangents waiting for their backward
    # With `stash` (the backward reads its forward's residuals,
    # `jdist.parallel.pipeline.residuals`): the slot a forward writes its residuals to and
    # its backward reads them from, and how many micro-batches' residuals a stage holds at
    # once (0 without stash).
    res_slot: tuple[tuple[int, ...], ...] = ()
    n_res_slots: int = 0
    # Split backwards (zero-bubble): the slot a forward writes the residuals its weight
    # gradient reads to, which the weight gradient frees (`res_slot` then holds those only
    # the backward reads, until it ran), and the slot the backward writes its hand-over to,
    # held only from the backward to the weight gradient.
    w_slot: tuple[tuple[int, ...], ...] = ()
    n_w_slots: int = 0
    h_slot: tuple[tuple[int, ...], ...] = ()
    n_h_slots: int = 0

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into BWD and WGT (not in a forward-only table)."""
        return bool(self.w_slot)

    @property
    def ticks(self) -> int:
        return len(self.grid)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def bubble_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks of the executed grid."""
        idle = sum(op is None for row in self.grid for op in row)
        return idle / (self.ticks * self.stages)

    def expected_bubble(self) -> float:
        """(P-1)/(V*M+P-1): GPipe's and 1F1B's (V=1) formula and its interleaved
        counterpart; split (zero-bubble), (P-1)/(3VM+P-1), a tick per F, B and W of a
        chunk: ZB-H1's, and ZB-V's (V=2) for M a multiple of P."""
        if self.split_backward:
            return (self.stages - 1) / (3 * self.virtual * self.micro + self.stages - 1)
        return (self.stages - 1) / (self.virtual * self.micro + self.stages - 1)

    def render(self) -> str:
        """A stage x tick grid: `F3` forward of micro-batch 3 (`F3.1` on virtual chunk 1),
        `B3` backward (split: to the input only), `W3` weight gradient, `.` idle."""
        def cell(op: Op | None) -> str:
            if op is None:
                return "."
            text = "?FBW"[op.kind] + str(op.micro)
            return f"{text}.{op.chunk}" if self.virtual > 1 else text

        cells = [[cell(self.grid[t][s]) for t in range(self.ticks)] for s in range(self.stages)]
        width = max(len(c) for row in cells for c in row)
        rows = [f"stage {s:>2} | " + " ".join(c.rjust(width) for c in cells[s])
                for s in range(self.stages)]
        return "\n".join([self.summary(), *rows])

    def summary(self) -> str:
        """One line: the schedule, its ticks and bubble, and what a stage stashes."""
        return (f"{self.name} schedule: pp={self.stages}, {self.micro} micro-batches"
                + (f", {self.virtual} virtual stages" if self.virtual > 1 else "")
                + f"; {self.ticks} ticks, bubble {self.bubble_fraction():.3f} "
                f"(formula {self.expected_bubble():.3f}); stashed activations per stage: "
                f"{self.n_slots}"
                + (f" chunk inputs, {self.n_res_slots} micro-batches' residuals"
                   if self.n_res_slots else "")
                + (f", {self.n_w_slots} read by weight gradients ({self.n_h_slots} awaiting "
                   "them)" if self.n_w_slots else ""))


@functools.lru_cache(maxsize=256)  # pure; the planner and memory model ask for the same tables
def build(schedule: str, stages: int, micro: int, virtual: int = 1,
          forward_only: bool = False, stash: bool = False) -> Schedule:
    """The executed schedule: play each stage's order against the data dependencies.
    `forward_only` (evaluation) keeps the forwards, in the same order, and frees each stashed
    input as soon as its forward has read it. `stash`: each backward reads its forward's
    residuals (kept in `res_slot`s) instead of recomputing from the chunk input, which its
    forward therefore frees (always, for a schedule that splits backwards)."""
    check(schedule, stages, micro, virtual, stages * virtual)
    if schedule in SPLIT_BACKWARD:
        stash = True  # what it splits is the backward of the forward's residuals
        grid = zero_bubble(schedule, stages, micro)
        # Evaluation: the same forwards in the same order, replayed without backwards.
        orders = [[row[s] for row in grid if row[s] is not None and row[s].kind == FWD]
                  for s in range(stages)]
    else:
        orders = op_orders(schedule, stages, micro, virtual)
    if forward_only:
        grid = simulate(schedule, [[op for op in order if op.kind == FWD] for order in orders],
                        stages, virtual)
    elif schedule not in SPLIT_BACKWARD:
        grid = simulate(schedule, orders, stages, virtual)
    return _with_slots(schedule, stages, micro, virtual, grid, stash and not forward_only)


def simulate(schedule: str, orders: list[list[Op]], stages: int,
             virtual: int) -> list[list[Op | None]]:
    """Greedy in-order execution: each tick, each stage runs the next op of its order if its
    inputs arrived in an earlier tick, else idles."""
    last = stages * virtual - 1
    done: dict[tuple[int, int, int], int] = {}  # (kind, micro, global chunk) -> tick
    pos = [0] * stages
    grid: list[list[Op | None]] = []
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        t = len(grid)
        require(t <= 4 * sum(map(len, orders)) + stages, "pipeline schedule deadlocked")
        row: list[Op | None] = []
        for s in range(stages):
            op = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            if op is not None:
                needs = _needs(op.kind, op.micro, chunk_index(schedule, s, op.chunk, stages),
                               last)
                if not all(done.get(n, t) < t for n in needs):
                    op = None
            row.append(op)
        for s, op in enumerate(row):
            if op is not None:
                done[(op.kind, op.micro, chunk_index(schedule, s, op.chunk, stages))] = t
                pos[s] += 1
        grid.append(row)
    return grid


def _needs(kind: int, micro: int, c: int, last: int) -> list[tuple[int, int, int]]:
    """The (kind, micro-batch, global chunk) operations an operation waits for: a forward
    for the previous chunk's forward, a backward for its own forward and the next chunk's
    backward, a weight gradient for its own backward."""
    if kind == FWD:
        return [(FWD, micro, c - 1)] if c > 0 else []
    if kind == BWD:
        return [(FWD, micro, c)] + ([(BWD, micro, c + 1)] if c < last else [])
    return [(BWD, micro, c)]


def _with_slots(name: str, stages: int, micro: int, virtual: int,
                grid: list[list[Op | None]], stash: bool = False) -> Schedule:
    """Assign buffer slots: a chunk input is stashed from its arrival until its backward ran,
    a cotangent from its arrival until its backward ran (a slot freed in a tick can take
    what arrives at the end of that tick). Without backwards (evaluation) an input is freed
    by its forward. With `stash`, the forward frees its input and keeps its residuals in a
    slot of their own until the backward reads them."""
    last = stages * virtual - 1
    ticks = len(grid)
    backwards = any(op is not None and op.kind == BWD for row in grid for op in row)
    shape = lambda: [[-1] * stages for _ in range(ticks)]
    in_slot, grad_slot, res_slot, w_slot, h_slot = (shape() for _ in range(5))
    recv_fwd, recv_bwd = ([shape() for _ in SOURCES] for _ in range(2))
    inputs = [_Slots() for _ in range(stages)]
    grads = [_Slots() for _ in range(stages)]
    residuals = [_Slots() for _ in range(stages)]
    weights = [_Slots() for _ in range(stages)]  # the residuals a split backward's W reads
    handed = [_Slots() for _ in range(stages)]   # and what its B hands over
    split = name in SPLIT_BACKWARD and backwards
    for t, row in enumerate(grid):
        for s, op in enumerate(row):  # reads first: backwards free their slots
            if op is None:
                continue
            c = chunk_index(name, s, op.chunk, stages)
            key = (op.micro, c)
            if op.kind == WGT:
                w_slot[t][s], h_slot[t][s] = weights[s].pop(key), handed[s].pop(key)
                continue
            if c > 0 and (op.kind == FWD or not stash):
                in_slot[t][s] = inputs[s].find(key)
            if c > 0 and (op.kind == BWD) != (stash or not backwards):  # its last reader ran
                inputs[s].free(key)
            if op.kind == BWD:
                if c < last:
                    grad_slot[t][s] = grads[s].pop(key)
                if stash:
                    res_slot[t][s] = residuals[s].pop(key)
                if split:
                    w_slot[t][s], h_slot[t][s] = weights[s].find(key), handed[s].take(key)
            elif stash:
                res_slot[t][s] = residuals[s].take(key)
                if split:
                    w_slot[t][s] = weights[s].take(key)
        for s, op in enumerate(row):  # then what this tick sends lands on the neighbour
            if op is None:
                continue
            c = chunk_index(name, s, op.chunk, stages)
            if op.kind == FWD and c < last:
                dst = stage_of(name, c + 1, stages)
                recv_fwd[_source(name, s, dst, FWD)][t][dst] = inputs[dst].take(
                    (op.micro, c + 1))
            if op.kind == BWD and c > 0:
                dst = stage_of(name, c - 1, stages)
                recv_bwd[_source(name, s, dst, BWD)][t][dst] = grads[dst].take(
                    (op.micro, c - 1))
    freeze = lambda table: tuple(tuple(r) for r in table)
    return Schedule(name, stages, micro, virtual, freeze(grid), freeze(in_slot),
                    freeze(grad_slot), tuple(map(freeze, recv_fwd)),
                    tuple(map(freeze, recv_bwd)),
                    max(1, max(s.high for s in inputs)), max(1, max(g.high for g in grads)),
                    freeze(res_slot) if stash else (),
                    max(r.high for r in residuals) if stash else 0,
                    freeze(w_slot) if split else (), max(w.high for w in weights),
                    freeze(h_slot) if split else (), max(h.high for h in handed))


def _source(name: str, sender: int, receiver: int, kind: int) -> int:
    """How what `sender` passes on reaches `receiver` (`SOURCES`): a forward's output goes
    up and a backward's cotangent down (wrapping from the last stage to the first under
    interleaving); in the V shape, by where the receiver is."""
    if sender == receiver:
        return SELF
    if name in V_SHAPED:
        return BELOW if receiver > sender else ABOVE
    return BELOW if kind == FWD else ABOVE


class _Slots:
    """Lowest-free-index slot allocator that remembers its high-water mark."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}
        self.high = 0

    def take(self, key: tuple[int, int]) -> int:
        used = set(self.held.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.held[key] = slot
        self.high = max(self.high, slot + 1)
        return slot

    def find(self, key: tuple[int, int]) -> int:
        return self.held[key]

    def free(self, key: tuple[int, int]) -> None:
        del self.held[key]

    def pop(self, key: tuple[int, int]) -> int:
        return self.held.pop(key)
