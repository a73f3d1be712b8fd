"""The collectives of one training step, predicted from the plan without compiling anything.

`step_traffic(plan, batch_size, seq_len)` returns what `jdist.comm.report` reads from the
compiled step's HLO: one `jdist.comm.Row` per collective kind and tuple of mesh axes, with
executions and bytes per device per step, in the convention of `jdist.hlo` (a collective's
bytes are its result's: an all-reduce's operand, a reduce-scatter's one shard, an
all-gather's the gathered array). It is arithmetic on the plan's shapes and shardings, so a
planner can cost hundreds of layouts of a 70B model in seconds. `collectives` lists the
same traffic item by item (`Collective`: per-execution bytes, dtype and the code that emits
it); `jdist.comm.transfer_time(kind, bytes per execution, group_size(plan, axes), link)`
prices one.

One small function per source of traffic, named after the code that emits it: per-layer
parameter gathers and gradient reductions (`jdist.parallel.grad_sync`), the embedding lookup
(`jdist.parallel.embedding`), the chunked loss (`jdist.parallel.vocab`), the context-
parallel kernels (`ring_attention`, `all_gather_attention`, `ulysses_attention`), the MoE
dispatch (`jdist.parallel.moe`), the pipeline's per-tick permutes and end-of-step sums
(`jdist.parallel.stage_program`, `jdist.train.pipelined`), and what GSPMD adds around
them: Megatron's tensor-parallel all-reduces, sequence parallelism's all-gathers, the
ZeRO-1/2 update's all-gathers, partial sums of gradients over automatic axes that split
the tokens, the gradient norm's scalars. What GSPMD and XLA do is described as jax 0.10.2
compiles the step on CPU ("empirical"), found by compiling steps and reading
`jdist.comm.report`; tests/test_plan_traffic.py keeps it honest. (By hand, 70 layouts of
`tiny`, `moe-tiny` and `small` matched the report's bytes per kind to 0.7%, most exactly.)

Conventions:
- dtypes are the program's: parameters gather in the compute dtype (norm scales in float32),
  gradients reduce in float32 (their partial sums over token axes in the dtype of the dot
  that made them), activations move in the compute dtype. The CPU backend upcasts bf16
  collectives to f32 after partitioning, so a CPU report of a bfloat16 step reads what
  `step_traffic` predicts for the same plan in float32 (`jdist.hlo.partitioned` shows the
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
  them. `jdist.comm.report` cannot know how often a `lax.switch` branch runs and counts
  each branch's collectives once; `reported_traffic` predicts that convention.
- `count` is executions per step before XLA's combiners merge small all-reduces into
  tuples (the report counts merged ones): bytes match the report, counts need not.

Not covered (estimates, unchecked against a compile): the tensor-parallel logits of
`--loss full` (their reductions are not modelled), packed documents' segment ids travelling
with the ring, sequence parallelism combined with context parallelism or expert
parallelism outside the layers, QLoRA's NF4 storage, rules other than the defaults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp

from jdist import axes as ax
from jdist import loss as objective
from jdist import sharding as sh
from jdist.comm import Row
from jdist.hlo import COLLECTIVES
from jdist.parallel.context import ALL_GATHER, RING
from jdist.parallel.grad_sync import Sync
from jdist.parallel.ulysses_attention import kv_repeats
from jdist.parallel.vocab import chunk_size
from jdist.rules import mesh_axes_of, resolve
from jdist.train import trainable
from jdist.train.context import context_parallel_of, inner_rules
from jdist.train.grads import MANUAL, syncs
from jdist.train.layer_order import BLOCKS, EMBED, HEAD
from jdist.zero import zero_dim

AR, AG, RS, PERMUTE, A2A = COLLECTIVES
F32, S32 = "f32", "s32"
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u8": 1, "s8": 1}
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8", "int8": "s8",
             "int32": "s32"}
FINAL_NORM = "final_norm"
PIPE_MANUAL = (ax.STAGE, *MANUAL)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One modelled collective: `count` executions per step over `axes` (mesh order), each
    with `elements` of `dtype` in its result per device; `source` names the emitting code."""

    kind: str
    axes: tuple[str, ...]
    count: int
    elements: int
    dtype: str
    source: str

    @property
    def bytes(self) -> int:
        """Result bytes per device of one execution."""
        return self.elements * ITEMSIZE[self.dtype]

    def times(self, n: int) -> Collective:
        return dataclasses.replace(self, count=self.count * n)


def group_size(plan, axes: Iterable[str]) -> int:
    """Devices in each group of a collective over `axes`: the product of their sizes."""
    return math.prod(plan.mesh.shape[a] for a in axes)


def step_traffic(plan, batch_size: int, seq_len: int) -> list[Row]:
    """Collectives of one training step of `plan` (a jdist.train.state.Plan, as
    jdist.train.setup.plan_for builds it; pipelined plans have plan.pipeline set) on a global
    batch of batch_size x seq_len tokens: one Row(kind, axes, count, bytes) per collective
    kind and tuple of mesh axes (mesh order, as jdist.comm.axes_of names them), bytes per
    device per step (count x bytes per execution), seconds left 0."""
    return to_rows(collectives(plan, batch_size, seq_len))


def reported_traffic(plan, batch_size: int, seq_len: int) -> list[Row]:
    """`step_traffic` as `jdist.comm.report` counts it: a pipeline's collectives inside the
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


# ---------------------------------------------------------------------------------------
# The step as one device sees it: sizes, parameter leaves, activation layouts


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter leaf as the step's replica shard_map sees it. A block leaf describes
    one layer (its stacked `layers` dimension dropped)."""

    key: str                 # top-level parameter: blocks, embed, head, final_norm
    size: int                # elements (of one layer, for a block leaf)
    auto: tuple[str, ...]    # automatic mesh axes (size > 1) splitting the stored leaf
    ways: int                # their product
    sync: Sync               # how grad_sync gathers it and reduces its gradient
    trained: bool
    matrix: bool             # a float weight of >= 2 dims: cast to compute dtype, fed to a dot
    dtype: str               # as stored (float32; a frozen base's compute dtype, NF4 codes)
    grad_groups: tuple[tuple[str, ...], ...]  # per split dimension, its gradient's axes
    stored: int              # elements per device as stored between steps (float32)
    zero_split: bool         # ZeRO-1/2 split its optimizer state over data (jdist.zero)

    @property
    def local(self) -> int:
        """Elements of the value a layer computes with (gathered over the replica axes)."""
        return self.size // self.ways


@dataclasses.dataclass(frozen=True)
class Step:
    """One step as a device of the plan's mesh sees it."""

    plan: object
    n: dict                  # mesh axis -> size
    batch: int
    seq: int
    micro: int               # micro-batches per step (grad_accum, or the pipeline's M)
    rows: int                # sequences per device per micro-batch
    dtype: str               # compute dtype (HLO name)
    tp: tuple[str, ...]      # axes splitting attention heads and MLP units (Megatron)
    cp: tuple[str, ...]      # axes splitting the attention's sequence (context parallel)
    sp: tuple[str, ...]      # further axes splitting the residual's sequence (Megatron SP)
    bt: tuple[str, ...]      # automatic axes splitting the batch (expert: data parallel there)
    leaves: tuple[Leaf, ...]

    @property
    def model(self):
        return self.plan.model

    def size(self, axes: Iterable[str]) -> int:
        return math.prod(self.n[a] for a in axes)

    @property
    def tokens(self) -> int:
        """Sequence positions per device in attention (the length split over cp)."""
        return self.seq // self.size(self.cp)

    @property
    def act(self) -> int:
        """Elements of one [rows, tokens, d_model] activation."""
        return self.rows * self.tokens * self.model.d_model

    def blocks(self) -> list[Leaf]:
        return [leaf for leaf in self.leaves if leaf.key == BLOCKS]

    def leaf(self, key: str) -> Leaf:
        return next(leaf for leaf in self.leaves if leaf.key == key)

    def shared(self) -> list[Leaf]:
        return [leaf for leaf in self.leaves if leaf.key != BLOCKS]


def _axes(names: Iterable[str], mesh) -> tuple[str, ...]:
    """The mesh axes (size > 1) among `names`, in mesh order."""
    names = set(names)
    return tuple(a for a in mesh.axis_names if a in names and mesh.shape[a] > 1)


def _resolved(plan, names: tuple[str, ...], dim: int, manual=MANUAL) -> tuple[str, ...]:
    """Mesh axes dimension `dim` of an activation named `names` splits over inside the
    step's shard_map (manual over `manual`)."""
    spec = resolve(names, inner_rules(plan.rules, manual), plan.mesh)
    return _axes(mesh_axes_of(spec[dim]), plan.mesh)


def leaves_of(plan) -> tuple[Leaf, ...]:
    """Every parameter leaf with its layout, from the plan's shardings and grad_sync."""
    mesh = plan.mesh
    # Every tree flattened up to the parameters' own leaves (an NF4 weight's codes and
    # scales are leaves; a leaf's logical names are one tuple), so the columns align.
    treedef = jax.tree_util.tree_structure(plan.abstract.params)
    flat = lambda tree, **_: treedef.flatten_up_to(tree)
    paths = jax.tree_util.tree_flatten_with_path(plan.abstract.params)[0]
    grads = trainable.combine(plan.grad_shardings, plan.shardings.params)
    base = sh.param_shardings(plan.abstract.params, plan.names, mesh, plan.rules)
    columns = zip(paths, flat(plan.shardings.params),
                  flat(syncs(plan), is_leaf=lambda x: isinstance(x, Sync)),
                  flat(grads), flat(base), flat(plan.names, is_leaf=lambda x: isinstance(x, tuple)))
    out = []
    for (path, leaf), stored, sync, grad, base_sh, names in columns:
        key = path[0].key
        drop = 1 if key == BLOCKS else 0  # a block leaf's layers dimension
        shape = tuple(leaf.shape)
        auto = _axes((a for e in tuple(stored.spec)[drop:] for a in mesh_axes_of(e)
                      if a not in ax.REPLICA_AXES), mesh)
        groups = tuple(_axes(mesh_axes_of(e), mesh) for e in grad.spec)
        out.append(Leaf(key, math.prod(shape[drop:]), auto, math.prod(mesh.shape[a] for a in auto),
                        sync, trainable.is_trainable(plan.model, path),
                        len(shape) - drop >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating),
                        HLO_DTYPE[jnp.dtype(leaf.dtype).name],
                        tuple(g for g in groups if g), math.prod(stored.shard_shape(shape)),
                        zero_dim(shape, base_sh.spec, names, mesh) is not None))
    return tuple(out)


def step_of(plan, batch_size: int, seq_len: int) -> Step:
    """The sizes and layouts every traffic function reads, from the plan's rules."""
    mesh = plan.mesh
    n = dict(mesh.shape)
    pipelined = plan.pipeline is not None
    micro = plan.pipeline.table(n[ax.STAGE]).micro if pipelined else plan.grad_accum
    manual = PIPE_MANUAL if pipelined else MANUAL
    batch_axes = _resolved(plan, (ax.BATCH, ax.LENGTH), 0, ())
    cp = _axes(context_parallel_of(plan, manual).axes, mesh)
    residual = _resolved(plan, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED), 1, manual)
    return Step(plan, n, batch_size, seq_len, micro,
                batch_size // math.prod(n[a] for a in batch_axes) // micro,
                HLO_DTYPE[jnp.dtype(plan.compute_dtype).name],
                _resolved(plan, (ax.HEADS,), 0, manual), cp,
                tuple(a for a in residual if a not in cp),
                _resolved(plan, (ax.BATCH, ax.LENGTH), 0, manual), leaves_of(plan))


# ---------------------------------------------------------------------------------------
# Parameters: gathered just in time, gradients reduced as produced (grad_sync)


def gather(st: Step, leaf: Leaf, source: str = "grad_sync.gather") -> list[Collective]:
    """`grad_sync.gather`: the stored block all-gathered over the replica axes it is split
    on, dimension by dimension, in the compute dtype (matrices) or float32 (norm scales)."""
    if not leaf.sync.gathers:
        return []
    dtype = st.dtype if leaf.matrix else leaf.dtype
    manual = math.prod(st.size(axes) for axes in leaf.sync.stored)
    out, full = [], leaf.local
    if leaf.auto:
        # Empirical (GSPMD, jax 0.10.2): an all_gather over manual axes of a block that
        # automatic axes (tensor, expert) split too is partitioned by first gathering it
        # over those, innermost first, so the whole leaf, not its shard, is gathered over
        # the replicas.
        out += _gather_auto(st, leaf, leaf.local // manual, dtype, source)
        full = leaf.size
    left = manual
    for axes in leaf.sync.stored:
        if axes:
            left //= st.size(axes)
            out.append(Collective(AG, _axes(axes, st.plan.mesh), 1, full // left, dtype, source))
    return out


def _gather_auto(st: Step, leaf: Leaf, elements: int, dtype: str, source: str
                 ) -> list[Collective]:
    """All-gathers of a block of `elements` over each automatic axis splitting the leaf,
    the innermost first (as GSPMD orders them)."""
    out = []
    for a in reversed(leaf.auto):
        elements *= st.n[a]
        out.append(Collective(AG, (a,), 1, elements, dtype, source))
    return out


def reduce(st: Step, leaf: Leaf, defer: bool, source: str = "grad_sync.reduce",
           elements: int | None = None, auto: tuple[str, ...] | None = None) -> list[Collective]:
    """`grad_sync.reduce` of one full float32 cotangent (`elements` per device, default the
    leaf's): an all-reduce over the replica axes its gradient is not split on (postponed
    to `finish` under `defer`), then a reduce-scatter per dimension it is split on."""
    if not leaf.trained:
        return []
    elements = leaf.local if elements is None else elements
    auto = leaf.auto if auto is None else auto
    mesh = st.plan.mesh
    out = []
    if leaf.sync.reduce and not defer:
        out.append(Collective(AR, _axes(leaf.sync.reduce, mesh), 1, elements, F32, source))
    if any(leaf.sync.grad):
        full = elements
        if auto:
            # Empirical (GSPMD, jax 0.10.2), as in `gather`: a psum_scatter over manual
            # axes of a cotangent split over automatic axes first gathers it whole there.
            out += _gather_auto(st, dataclasses.replace(leaf, auto=auto), elements, F32, source)
            full = elements * st.size(auto)
        for axes in leaf.sync.grad:
            if axes:
                full //= st.size(axes)
                out.append(Collective(RS, _axes(axes, mesh), 1, full, F32, source))
    return out


def finish(st: Step, leaf: Leaf, layers: int) -> list[Collective]:
    """`grad_sync.finish_reduce`: the all-reduce `defer` postponed, once per step, of the
    accumulated gradient as laid out (a block leaf's stack of `layers`)."""
    if not (leaf.trained and leaf.sync.reduce):
        return []
    split = math.prod(st.size(axes) for axes in leaf.sync.grad)
    return [Collective(AR, _axes(leaf.sync.reduce, st.plan.mesh), 1,
                       layers * leaf.local // split, F32, "grad_sync.finish_reduce")]


def regathers(st: Step, leaf: Leaf) -> bool:
    """Whether a layer's backward gathers this leaf again. Gathered parameters are never
    kept for the backward (jdist.remat.GATHERED) except under `everything_saveable`; with
    `--remat none` a norm scale is not regathered either: its backward reads the broadcast
    scale, which that policy keeps (empirical, jax 0.10.2)."""
    if st.plan.remat == "everything_saveable":
        return False
    return leaf.matrix or st.plan.remat != "none"


def token_partials(st: Step, leaf: Leaf) -> list[Collective]:
    """Empirical (GSPMD, jax 0.10.2): where automatic axes split the tokens a weight
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


# ---------------------------------------------------------------------------------------
# One transformer layer (models/llama.py Block) of one micro-batch


def layer_forward(st: Step) -> list[Collective]:
    """A layer's forward: its parameters gathered, Megatron's activation collectives, the
    context-parallel kernel's, the MoE dispatch's."""
    gathers = [c for leaf in st.blocks() for c in gather(st, leaf)]
    return gathers + tensor_forward(st) + attention_forward(st) + moe_forward(st)


def layer_backward(st: Step, defer: bool, merged: Callable[[Leaf], bool] = lambda _: False
                   ) -> list[Collective]:
    """A layer's backward: parameters gathered again (`regathers`; not those whose
    regather XLA `merged` with an earlier identical gather), recomputation, Megatron's,
    the attention kernel's and the MoE dispatch's backward, gradient reductions."""
    out = [c for leaf in st.blocks() if regathers(st, leaf) and not merged(leaf)
           for c in gather(st, leaf, "grad_sync.gather (backward)")]
    out += tensor_backward(st) + attention_backward(st) + moe_backward(st)
    for leaf in st.blocks():
        out += token_partials(st, leaf) + reduce(st, leaf, defer)
    return out


def tensor_forward(st: Step) -> list[Collective]:
    """Megatron under GSPMD: the row-parallel attention-output and MLP-down projections
    each all-reduce [rows, tokens, d_model] over tensor; with sequence parallelism the
    normed inputs of attention and MLP are first all-gathered over it."""
    if not st.tp:
        return []
    dense = 0 if st.model.n_experts else 1  # an MoE MLP reduces inside its kernel
    out = [Collective(AR, st.tp, 1 + dense, st.act, st.dtype,
                      "GSPMD: Megatron row-parallel outputs")]
    out += _lora_partials(st, ("o", "down"))
    if st.sp:
        out.append(Collective(AG, st.sp, 2, st.act, st.dtype, "GSPMD: sequence-parallel inputs"))
    return out


def tensor_backward(st: Step) -> list[Collective]:
    """Empirical (GSPMD, jax 0.10.2): the input gradients of q, k, v, gate and up are each
    all-reduced over tensor (5, not 2: the partial sums are not added first); with SP, 4
    blocks are gathered. `--remat full` redoes the attention output's all-reduce (the
    MLP's is dead code there); the selective and dots policies keep the projections."""
    if not st.tp:
        return []
    again = 1 if st.plan.remat == "full" else 0
    dense = 0 if st.model.n_experts else 2
    out = [Collective(AR, st.tp, 3 + dense + again, st.act, st.dtype,
                      "GSPMD: Megatron input grads")]
    out += _lora_partials(st, ("q", "k", "v", "gate", "up") + (("o",) if again else ()))
    if st.sp:
        out.append(Collective(AG, st.sp, 4, st.act, st.dtype, "GSPMD: sequence-parallel grads"))
    return out


def _moe_buffer(st: Step) -> int:
    """Elements of one device's dispatch buffer [experts, capacity, d_model]
    (models.moe.capacity_of: all its tokens when dropless)."""
    m = st.model
    tokens = st.rows * st.seq // st.size(st.cp + st.sp)
    capacity = tokens if m.moe_routing == "dropless" else \
        max(1, math.ceil(m.capacity_factor * tokens * m.top_k / m.n_experts))
    return m.n_experts * capacity * m.d_model


def _moe_moves(st: Step, backward: bool) -> list[Collective]:
    """jdist.parallel.moe: the dispatch buffer all-to-all'ed to the experts' devices and
    back over the expert axes, the experts' output summed over the tensor axes splitting
    their hidden units; backward the same reversed, with gate's and up's input gradients
    summed separately (empirical, jax 0.10.2)."""
    ep = _resolved(st.plan, (ax.EXPERTS,), 0)
    tp = _resolved(st.plan, (ax.EXPERTS, ax.EMBED, ax.MLP), 2)
    out = []
    if ep:
        out.append(Collective(A2A, ep, 2, _moe_buffer(st), st.dtype, "moe: dispatch, combine"))
    if tp:
        out.append(Collective(AR, tp, 2 if backward else 1, _moe_buffer(st), st.dtype,
                              "moe: expert hidden units"))
    return out


def moe_forward(st: Step) -> list[Collective]:
    """The MoE kernel's forward, and its balance statistics (2 E + 2 floats) summed over
    the kernel's token axes."""
    m = st.model
    if not m.n_experts:
        return []
    tokens = _axes(set(st.bt) | set(st.cp) | set(st.sp), st.plan.mesh)
    stats = [Collective(AR, tokens, 1, 2 * m.n_experts + 2, F32, "moe: balance sums")]
    return _moe_moves(st, False) + (stats if tokens else [])


def moe_backward(st: Step) -> list[Collective]:
    """The MoE kernel's backward; `--remat full` redoes its forward first (not checked
    against a compile)."""
    if not st.model.n_experts:
        return []
    again = _moe_moves(st, False) if st.plan.remat == "full" else []
    return again + _moe_moves(st, True)


def _lora_partials(st: Step, projections: tuple[str, ...]) -> list[Collective]:
    """LoRA (models/lora.py) beside each of those Megatron all-reduces: x·A of a
    row-parallel projection, and the gradient through B of a column-parallel one, are
    partial sums over tensor too: [rows, tokens, rank] each (empirical, jax 0.10.2)."""
    lora = st.model.lora
    if lora is None:
        return []
    n = sum(1 for t in projections if t in lora.targets)
    return [Collective(AR, st.tp, n, st.act // st.model.d_model * lora.rank, st.dtype,
                       "GSPMD: LoRA adapter partial sums")] if n else []


def _kv(st: Step, tokens: int | None = None) -> int:
    """Elements of k (or v) per device: [rows, tokens, kv heads / tensor, head_dim]."""
    m = st.model
    heads = m.n_kv_heads // st.size(_resolved(st.plan, (ax.KV_HEADS,), 0))
    return st.rows * (tokens or st.tokens) * heads * m.dim_per_head


def _q(st: Step) -> int:
    m = st.model
    return st.rows * st.tokens * (m.n_heads // st.size(st.tp)) * m.dim_per_head


def _ulysses_kv(st: Step) -> int:
    """k (or v) as ulysses moves it: kv heads repeated until they split over cp."""
    m = st.model
    heads = m.n_kv_heads // st.size(_resolved(st.plan, (ax.KV_HEADS,), 0))
    return _kv(st) * kv_repeats(heads, st.size(st.cp))


def _shift(st: Step, count: int, elements: int, dtype: str, source: str) -> Collective:
    """`ring_attention.Ring.shift` of one block: a permute, or inside a pipeline stage an
    all-gather of the whole ring's blocks (a permute there would pair with another
    stage's; see its docstring)."""
    if st.plan.pipeline is None:
        return Collective(PERMUTE, st.cp, count, elements, dtype, source)
    return Collective(AG, st.cp, count, elements * st.size(st.cp), dtype, source)


def _ring_merges(st: Step) -> bool:
    """Empirical (XLA, jax 0.10.2): a ring of two devices has no loop left, and the shifts
    of k and v a recomputed forward runs are the backward's first ones, merged."""
    return st.plan.cp_strategy == RING and st.size(st.cp) == 2


def attention_forward(st: Step) -> list[Collective]:
    """The context-parallel kernel's forward (jdist.parallel.context)."""
    if not st.cp:
        return []
    n, dt = st.size(st.cp), st.dtype
    if st.plan.cp_strategy == RING:  # ring_attention._forward: N-1 shifts of k and v
        return [_shift(st, 2 * (n - 1), _kv(st), dt, "ring_attention: k, v")]
    if st.plan.cp_strategy == ALL_GATHER:  # all_gather_attention._local
        return [Collective(AG, st.cp, 2, _kv(st, st.seq), dt, "all_gather_attention: k, v")]
    return [Collective(A2A, st.cp, 2, _q(st), dt, "ulysses_attention: q, out"),
            Collective(A2A, st.cp, 2, _ulysses_kv(st), dt, "ulysses_attention: k, v")]


def attention_backward(st: Step) -> list[Collective]:
    """The kernel's backward: the ring again with dk/dv travelling along in float32 and a
    last shift home; all_gather's k/v gathered again and dk/dv reduce-scattered; ulysses'
    four all-to-alls reversed. Every remat policy but none and everything_saveable redoes
    the kernel's forward first: its custom-VJP residuals (out, lse) carry no name a policy
    keeps (empirical, jax 0.10.2; all_gather's regathers are the backward's own)."""
    if not st.cp:
        return []
    n, dt = st.size(st.cp), st.dtype
    again = attention_forward(st) \
        if st.plan.remat not in ("none", "everything_saveable") and not _ring_merges(st) else []
    if st.plan.cp_strategy == RING:
        return again + [_shift(st, 2 * (n - 1), _kv(st), dt, "ring_attention: k, v"),
                        _shift(st, 2 * n, _kv(st), F32, "ring_attention: dk, dv")]
    if st.plan.cp_strategy == ALL_GATHER:
        return [Collective(AG, st.cp, 2, _kv(st, st.seq), dt, "all_gather_attention: k, v"),
                Collective(RS, st.cp, 2, _kv(st), dt, "all_gather_attention: dk, dv")]
    return again + [Collective(A2A, st.cp, 2, _q(st), dt, "ulysses_attention: dq, dout"),
                    Collective(A2A, st.cp, 2, _ulysses_kv(st), dt, "ulysses_attention: dk, dv")]


# ---------------------------------------------------------------------------------------
# Outside the layers, per micro-batch: embedding, final norm, loss


def _vocab_axes(st: Step, leaf: Leaf, vocab_dim: int) -> tuple[str, ...]:
    spec = tuple(st.plan.shardings.params[leaf.key].spec) + (None,) * 2
    return _axes((a for a in mesh_axes_of(spec[vocab_dim]) if a not in ax.REPLICA_AXES),
                 st.plan.mesh)


def _embed_split(st: Step) -> tuple[str, ...]:
    """Replica axes splitting the table's embed dimension (the lookup's G)."""
    sync = st.leaf(EMBED).sync
    return _axes(sync.stored[1], st.plan.mesh) if len(sync.stored) > 1 else ()


def _lookup_supported(st: Step) -> bool:
    sync = st.leaf(EMBED).sync  # embedding.supports
    return not sync.stored[0] and not sync.grad[0]


def embedding_forward(st: Step) -> list[Collective]:
    """jdist.parallel.embedding forward: token ids all-gathered over the replica axes G
    splitting the table's embed dimension, each vocab shard's rows summed over tensor
    (float32, before the cast), an all-to-all of the rows back to their replica."""
    if not _lookup_supported(st):  # the table gathered whole, as any parameter
        return gather(st, st.leaf(EMBED), "grad_sync.gather (embedding)")
    split = _embed_split(st)
    # The replica's rows, all of them on every device of an automatic batch axis (expert).
    tokens, d = st.rows * st.size(st.bt) * st.seq, st.model.d_model
    vocab = _vocab_axes(st, st.leaf(EMBED), 0)
    out = []
    if split:
        out.append(Collective(AG, split, 1, tokens * st.size(split), S32, "embedding: ids"))
    if vocab:
        out.append(Collective(AR, vocab, 1, tokens * d, F32, "embedding: rows over vocab"))
    if split:
        out.append(Collective(A2A, split, 1, tokens * d, st.dtype, "embedding: rows"))
    return out


def embedding_backward(st: Step, defer: bool) -> list[Collective]:
    """jdist.parallel.embedding backward: the all-to-all reversed in float32, then the
    table block's gradient (already summed over G) reduced like any parameter's."""
    leaf = st.leaf(EMBED)
    if not _lookup_supported(st):
        return reduce(st, leaf, defer, "grad_sync.reduce (embedding)")
    split = _embed_split(st)
    out = []
    if split and leaf.trained:  # a frozen table's rows need no gradient
        out.append(Collective(A2A, split, 1, st.rows * st.size(st.bt) * st.seq * st.model.d_model,
                              F32, "embedding: row gradients"))
    further = tuple(g[len(s):] for s, g in zip(leaf.sync.stored, leaf.sync.grad))
    table = dataclasses.replace(leaf, sync=dataclasses.replace(leaf.sync, grad=further))
    return out + reduce(st, table, defer, "embedding: table gradient",
                        leaf.local // st.size(split))


def final_norm_grad(st: Step, defer: bool) -> list[Collective]:
    """The final norm scale's gradient: partial sums over token axes, then grad_sync's."""
    leaf = st.leaf(FINAL_NORM)
    return token_partials(st, leaf) + reduce(st, leaf, defer, "grad_sync.reduce (final norm)")


@dataclasses.dataclass(frozen=True)
class LossShape:
    """How jdist.train.context.token_losses runs vocab_parallel_cross_entropy."""

    leaf: Leaf               # the head, or the tied table
    vocab: tuple[str, ...]   # axes the vocabulary is split over in the kernel
    tokens: tuple[str, ...]  # axes the tokens are split over in the kernel
    chunk: int               # vocabulary rows per chunk (vocab.chunk_size)
    n_chunks: int
    local_tokens: int        # tokens per device per micro-batch in the kernel


def loss_shape(st: Step) -> LossShape | None:
    """The chunked loss's layout; None where the step gathers the head whole instead
    (`--loss full`, or a vocabulary split over replica axes: context.head_of)."""
    tied = st.model.tie_embeddings
    leaf, vocab_dim = st.leaf(EMBED if tied else HEAD), 0 if tied else 1
    if st.plan.loss != objective.CHUNKED or leaf.sync.stored[vocab_dim] \
            or leaf.sync.grad[vocab_dim]:
        return None
    vocab = _vocab_axes(st, leaf, vocab_dim)
    manual = PIPE_MANUAL if st.plan.pipeline is not None else MANUAL
    spec = resolve((ax.BATCH, ax.LENGTH), inner_rules(st.plan.rules, manual), st.plan.mesh)
    tokens = _axes((a for e in spec for a in mesh_axes_of(e) if a not in vocab), st.plan.mesh)
    batch_axes = [a for a in tokens if a in mesh_axes_of(spec[0])]
    local_tokens = st.rows * st.size(batch_axes) * st.seq // st.size(tokens)
    local_vocab = st.model.vocab_size // st.size(vocab)
    chunk = chunk_size(local_tokens, local_vocab)
    return LossShape(leaf, vocab, tokens, chunk, -(-local_vocab // chunk), local_tokens)


def head_gathers(st: Step, shape: LossShape) -> list[Collective]:
    """vocab._weight_chunk, for every chunk: its rows of the head all-gathered over the
    replica axes splitting the embed dimension, in the compute dtype. (Inside the kernel,
    manual over the vocab axes too: no tensor gather first.)"""
    out, left = [], math.prod(st.size(axes) for axes in shape.leaf.sync.stored)
    full = shape.chunk * st.model.d_model
    for axes in shape.leaf.sync.stored:
        if axes:
            left //= st.size(axes)
            out.append(Collective(AG, _axes(axes, st.plan.mesh), shape.n_chunks, full // left,
                                  st.dtype, "vocab: head chunks"))
    return out


def loss_forward(st: Step, shape: LossShape, picked: bool = True) -> list[Collective]:
    """vocab._forward: each token's max, sum-exp and label logit reduced over the vocab
    axes (float32). A recompute that needs only the log-sum-exp drops the label logit's
    (`picked` False)."""
    if not shape.vocab:
        return []
    return [Collective(AR, shape.vocab, 3 if picked else 2, shape.local_tokens, F32,
                       "vocab: max, sum-exp, label logit")]


def loss_backward(st: Step, shape: LossShape, defer: bool) -> list[Collective]:
    """vocab._backward: each chunk's dW summed over the token axes, then reduced as
    grad_sync reduces every parameter; the hidden states' gradient summed over vocab."""
    d = st.model.d_model
    per_chunk = []
    if shape.tokens and shape.leaf.trained:
        per_chunk.append(Collective(AR, shape.tokens, 1, shape.chunk * d, F32,
                                    "vocab: head chunk gradient over token axes"))
    per_chunk += reduce(st, shape.leaf, defer, "vocab: head chunk gradient",
                        shape.chunk * d, ())
    out = [c.times(shape.n_chunks) for c in per_chunk]
    if shape.vocab:
        out.append(Collective(AR, shape.vocab, 1, shape.local_tokens * d, F32,
                              "vocab: hidden-state gradient"))
    return out


@dataclasses.dataclass(frozen=True)
class Extras:
    """What GSPMD adds around the embedding and the loss when an automatic axis splits the
    sequence (Megatron SP's tensor, context parallelism's sequence), by where it runs."""

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


def sequence_parallel_extras(st: Step) -> Extras:
    """Empirical (GSPMD, jax 0.10.2), Megatron SP outside the layers: the token ids (for
    the lookup) and the targets, the loss's hidden states (compute dtype) and the per-token
    loss gradient are gathered over tensor, and so are the embedding's row gradients
    (float32; a split table's also after its all-to-all); the loss sum and the token
    count are all-reduced there."""
    if not st.sp:
        return Extras()
    tokens, d, sp = st.rows * st.seq, st.model.d_model, st.sp
    split = 1 if _embed_split(st) else 0
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
    """Empirical (GSPMD, jax 0.10.2), context parallelism outside the layers: the ring's
    reorder gathers token ids and targets whole (context.reorder_tokens); the embedding's
    backward gathers ids (unless the reorder did, for a vocab-parallel lookup) and the rows'
    gradients over the sequence, a split table's gathered ids and rows too; the loss sum
    and the token count are all-reduced there."""
    if not st.cp:
        return Extras()
    tokens, d, cp = st.rows * st.seq, st.model.d_model, st.cp
    split, ring = _embed_split(st), st.plan.cp_strategy == RING
    ids = 0 if ring and _vocab_axes(st, st.leaf(EMBED), 0) else 1
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
    """Empirical (GSPMD, jax 0.10.2): an automatic axis splitting the batch (expert, which
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


def balance_totals(st: Step) -> list[Collective]:
    """jdist.loss.loss_terms: an MoE model's balance statistics of every layer summed over
    the replica axes, per micro-batch."""
    m = st.model
    replicas = _axes(MANUAL, st.plan.mesh)
    if not (m.n_experts and replicas):
        return []
    return [Collective(AR, replicas, 1, m.n_layers * (2 * m.n_experts + 3), F32,
                       "loss: balance statistics over replicas")]


# ---------------------------------------------------------------------------------------
# Once per step


def zero_update(st: Step) -> list[Collective]:
    """ZeRO-1/2: the optimizer updates each parameter's data shard, and GSPMD all-gathers
    the updated parameter over data into its stored layout (float32)."""
    if st.plan.zero not in (1, 2) or st.n[ax.DATA] == 1:
        return []
    return [Collective(AG, (ax.DATA,), 1, leaf.stored, F32, "GSPMD: ZeRO-1/2 update")
            for leaf in st.leaves if leaf.trained and leaf.zero_split]


def scalars(st: Step, manual: tuple[str, ...]) -> list[Collective]:
    """Scalar all-reduces: the counted targets (int32) and the loss terms over the replica
    axes, and the gradient norm's partial sums of squares, twice per trained leaf (optax's
    clipping and the grad_norm metric are not merged) and per dimension it is split on."""
    mesh = st.plan.mesh
    out = [Collective(AR, _axes(MANUAL, mesh), 1, 1, S32, "loss: token count"),
           Collective(AR, _axes(manual, mesh), 1, len(objective.term_names(st.model)), F32,
                      "loss: terms")]
    return out + [Collective(AR, group, 2, 1, F32, "optax: gradient norm")
                  for leaf in st.leaves if leaf.trained for group in leaf.grad_groups]


# ---------------------------------------------------------------------------------------
# The whole step


def collectives(plan, batch_size: int, seq_len: int, executed: bool = True) -> list[Collective]:
    """Every modelled collective of one step. `executed` False: a pipeline's collectives
    inside the stage's branches once each, as `jdist.comm.report` counts them."""
    st = step_of(plan, batch_size, seq_len)
    return pipelined_step(st, executed) if plan.pipeline is not None else plain_step(st)


def plain_step(st: Step) -> list[Collective]:
    """jdist.train.grads: the replica shard_map, `grad_accum` micro-batches scanned."""
    defer, layers = st.micro > 1, st.model.n_layers
    per_micro = [c.times(layers) for c in layer_forward(st) + layer_backward(st, defer)]
    per_micro += embedding_forward(st) + embedding_backward(st, defer)
    per_micro += final_norm_grad(st, defer)
    extras = sequence_parallel_extras(st) + context_parallel_extras(st) + \
        batch_split_extras(st)
    per_micro += balance_totals(st) + extras.embed_forward + extras.embed_backward
    per_micro += extras.loss_forward + extras.loss_backward
    # The final norm's gather is loop-invariant: XLA hoists it out of the micro-batch scan
    # and merges the backward's with it (once per step; jax 0.10.2).
    once = gather(st, st.leaf(FINAL_NORM), "grad_sync.gather (final norm)")
    shape = loss_shape(st)
    if shape is None:
        head = st.leaf(EMBED if st.model.tie_embeddings else HEAD)
        once += gather(st, head, "grad_sync.gather (head)")
        per_micro += reduce(st, head, defer, "grad_sync.reduce (head)")
    else:
        per_micro += loss_forward(st, shape) + loss_backward(st, shape, defer)
        if shape.n_chunks == 1:  # forward's and backward's gathers merged, and hoisted
            once += head_gathers(st, shape)
        else:  # inside the forward's and the backward's chunk loops
            per_micro += [c.times(2) for c in head_gathers(st, shape)]
    out = [c.times(st.micro) for c in per_micro] + once + extras.per_step
    if defer:
        out += [c for leaf in st.leaves
                for c in finish(st, leaf, layers if leaf.key == BLOCKS else 1)]
    return out + zero_update(st) + scalars(st, MANUAL)


def chunk_recompute(st: Step, k: int) -> list[Collective]:
    """The forward a pipeline backward redoes (jax.vjp of the chunk), its ring shifts
    merged with the backward's where `_ring_merges`."""
    out = [c for leaf in st.blocks() for c in gather(st, leaf)] + tensor_forward(st)
    return out + ([] if _ring_merges(st) else attention_forward(st)) + moe_forward(st)


def pipelined_step(st: Step, executed: bool) -> list[Collective]:
    """jdist.train.pipelined + stage_program: per tick a forward or backward of one chunk
    of k = L / (P V) layers inside a `lax.switch`, then two permutes; a backward redoes
    its chunk's forward (jax.vjp) before pulling the cotangent back. The embedding runs in
    the first chunk, the final norm and loss in the last; gradients accumulate (defer),
    shared ones are summed over stage once."""
    table = st.plan.pipeline.table(st.n[ax.STAGE])
    k = st.model.n_layers // (table.stages * table.virtual)
    chunk_runs = table.micro * table.virtual if executed else 1
    end_runs = table.micro if executed else 1
    forward = [c.times(k) for c in layer_forward(st)]
    backward = [c.times(k) for c in chunk_recompute(st, k) + layer_backward(
        st, True, merged=lambda leaf: k == 1 and not leaf.auto)]
    extras = sequence_parallel_extras(st) + context_parallel_extras(st) + \
        batch_split_extras(st)
    first = embedding_forward(st) + extras.embed_forward
    first_back = first + embedding_backward(st, True) + extras.embed_backward
    norm = gather(st, st.leaf(FINAL_NORM), "grad_sync.gather (final norm)")
    shape = loss_shape(st)
    if shape is None:
        head = st.leaf(EMBED if st.model.tie_embeddings else HEAD)
        last = norm + gather(st, head, "grad_sync.gather (head)")
        last_back = last + reduce(st, head, True, "grad_sync.reduce (head)")
    else:  # the backward redoes the loss's forward (log-sum-exp only), then its backward
        last = norm + head_gathers(st, shape) + loss_forward(st, shape)
        last_back = norm + head_gathers(st, shape) + loss_forward(st, shape, picked=False) \
            + head_gathers(st, shape) + loss_backward(st, shape, True)
    last += extras.loss_forward
    last_back += final_norm_grad(st, True) + extras.loss_recompute + extras.loss_backward \
        + extras.loss_backward_again
    out = [c.times(chunk_runs) for c in forward + backward]
    out += [c.times(end_runs) for c in first + first_back + last + last_back]
    out += extras.per_step
    # stage_program: after every tick the output activation goes to the next stage and
    # the input cotangent to the previous one (compute dtype), idle ticks included.
    out.append(Collective(PERMUTE, (ax.STAGE,), 2 * table.ticks, st.act // st.size(st.sp),
                          st.dtype, "stage_program: activations, cotangents"))
    for leaf in st.shared():  # pipelined._run: shared gradients summed over stage
        if leaf.trained:
            split = math.prod(st.size(axes) for axes in leaf.sync.grad)
            out.append(Collective(AR, (ax.STAGE,), 1, leaf.local // split, F32,
                                  "pipelined: shared gradients over stage"))
    layers = st.model.n_layers // table.stages
    out += [c for leaf in st.leaves for c in finish(st, leaf, layers if leaf.key == BLOCKS else 1)]
    return out + zero_update(st) + scalars(st, PIPE_MANUAL)
