"""Per-device memory: an analytical plan, and what the compiler actually allocates.

The plan makes mixed-precision Adam's accounting explicit, per device:
  parameters   float32 master weights, sharded as the ZeRO stage says (+ a bf16 compute copy
               when --compute-dtype bfloat16)
  gradients    float32, replicated over data until ZeRO-2 shards them
  optimizer    two float32 Adam moments (Muon: one momentum for the blocks' matrices, and
               its update's temporaries in the activations term), sharded over data from
               ZeRO-1 (on the host with --offload optimizer; with --offload params all
               three are, and the device holds two layers' stored blocks and the shared
               parameters with their gradients: `streamed_bytes`; with --offload disk
               in files, the update holding one group's: `disk_update.update_bytes`)
  activations  the larger of the backward's and the update's temporaries. The backward:
               every layer's residuals by --remat policy for one micro-batch, one layer's
               backward working set (or the loss's), one layer's gathered parameters and a
               leaf's unreduced gradient, the embedding's scatter-add block; pipelined,
               the schedule's stashed chunk inputs and one chunk's recomputation. The
               update: one more gradient-sized tree (gradient clipping's output)

`python -m jdist.memory --model 7b --mesh fsdp=8 --zero 3 [--measure] [--json]` prints it
(`jdist/memory/__main__.py`); `--measure` compiles the real step ahead of time on abstract
inputs (nothing allocated) and reads `compiled.memory_analysis()`. The fit check a run
makes before it starts lives in `jdist.train.fit`.
"""

from __future__ import annotations

import dataclasses

from jdist.models.loss import CHUNKED
from jdist.models.runs import runs as model_runs
from jdist.parallel.attention.blockwise import KEY_TILE, Q_TILE
from jdist.parallel.moe import expert_factor, overlap_pieces
from jdist.parallel.vocab import chunk_size
from jdist.spmd.sharding import per_device_bytes
from jdist.step import device_walk, disk_update, muon_cost, trainable

COMPONENTS = ("params", "grads", "optimizer", "activations")


@dataclasses.dataclass
class Breakdown:
    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state: what ZeRO shards."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def zero_textbook(params: float, grads: float, optimizer: float, n: int, stage: int) -> float:
    """Per-device state under ZeRO `stage` with `n` data-parallel devices (the ZeRO paper's
    accounting): each stage divides one more component by n."""
    return (params / (n if stage >= 3 else 1) + grads / (n if stage >= 2 else 1)
            + optimizer / (n if stage >= 1 else 1))


# The GPU compiler's program differs from the CPU's the model was first fitted to (H100
# target, jax 0.10.2; the fit: docs/measurements.md#memory-model-fits): its peak falls in
# the forward layer loop, where a fused layer under `--remat full` holds about six
# [tokens, d_ff] pieces (not the CPU's whole unfused backward); accumulation keeps a third
# gradient tree; and some parameter stacks are copied whole, transposed
# (`transposed_stacks`). Fitted, not derived: what `--verify` compiles is the check.
GPU_FULL_MLP_PIECES = 6


def activation_bytes(plan, micro_batch: int, seq_len: int, compute_bytes: int,
                     remat: str) -> int:
    """Bytes the step holds for one micro-batch besides the state, per device, by what
    allocates them (compiled on XLA CPU and read off the buffer assignment of `small`/`7b`
    steps): every layer's residuals kept for the backward (`--remat` policy), one layer's
    backward working set, the loss's, and pipelined, the schedule's stashed chunk inputs
    and cotangents (one pipeline micro-batch each) with the tick's buffers; a pipeline stage
    runs one chunk of layers at a time, so its "every layer" is one chunk's, held for each
    micro-batch in flight when the backward reads the forward's residuals (`stashes`)."""
    from jdist.parallel.moe import keeps_exchanges
    from jdist.parallel.pipeline import stashes
    from jdist.spmd import axes as ax

    m, cfg = plan.mesh.shape, plan.model
    layers, stashed, ticks, accumulator, held, awaiting, handed = cfg.n_layers, 0, 0, 0, 0, \
        0, 0
    if plan.pipeline is not None:
        table = plan.pipeline.table(m[ax.STAGE], stash=stashes(remat))
        micro_batch, layers = micro_batch // table.micro, cfg.n_layers // table.chunks
        stashed = table.n_slots + table.n_grad_slots
        held = table.n_res_slots  # micro-batches whose chunk residuals wait in the stash
        # Split (zero-bubble, jdist.parallel.pipeline.split_backward): the micro-batches whose
        # residuals the weight gradient reads, from forward to weight gradient, and those
        # whose input half's hand-over awaits it.
        awaiting, handed = table.n_w_slots, table.n_h_slots
        # stage_program.tick: the zeros of an idle branch, the chunk input read from the
        # stash, the forward output and the input cotangent passed on by the permutes.
        ticks = 4
        if table.virtual > 1:  # `acc[0].at[v].add(g)` in a switch branch: XLA copies the
            accumulator = _grad_bytes(plan, blocks_only=True)  # stage's stacked gradients
        elif m[ax.SEQUENCE] > 1:  # tokens split over `sequence` inside the stage: the
            # accumulated block gradients are summed over it (GSPMD) into a new buffer
            # (small pp=2,sp=4 1f1b, jax 0.10.2: one stage's gradients; interleaved holds
            # one such copy in all, not two)
            accumulator = _grad_bytes(plan, blocks_only=True)
    elif plan.compute.grad_accum > 1:  # jdist.step.grads.step_grads: the scan's float32
        accumulator = _grad_bytes(plan)  # accumulator beside each micro-batch's gradient
        if on_gpu(plan) and remat == "full":  # the peak is in the forward, inside the
            # accumulation loop: one more gradient tree, of a ZeRO-2 gradient's size (fitted)
            accumulator += _grad_bytes(plan) // (m[ax.DATA] if plan.zero < 2 else 1)
    # The average layer's sizes for what the layers keep; the largest run's for one layer's
    # backward (a heterogeneous stack's peak is in its widest blocks: `_per_layer`).
    a, largest = _per_layer(plan, micro_batch, seq_len, compute_bytes)
    if not keeps_exchanges(remat, cfg, dict(m)):  # `full` sends them again in the backward
        a, largest = (dataclasses.replace(s, exchanged=0) for s in (a, largest))
    gathered = _gathered_layer(plan, compute_bytes)[0]
    per_layer = _kept(a, remat, gathered)
    # One layer's backward holds, besides the cotangents of the block's input and output:
    # keeping every residual, the largest of their slices read out of the stacks (copies
    # on XLA CPU; a loop of one layer is unrolled and reads them in place), the MLP
    # backward's cotangents (d(hidden), d(gate), d(up) and the transposed copy a
    # weight-gradient matmul reads) and the score blocks a blockwise kernel's backward
    # recomputes, each freeing what it is computed from; under a policy, what it
    # recomputes (the rest is read from the stacks) and beside it the larger of two MLP
    # cotangents and those score blocks (the attention's backward comes after the MLP's).
    # An MoE layer's routed experts carry no names, so `full` recomputes what `selective`
    # does (H100 compiler, jax 0.10.2, qwen3-30b-a3b 2 layers: selective and full compile
    # to 14.93 and 14.91 GiB on ep=8, 10.47 and 10.35 on dp=2,ep=2,tp=4).
    saves_all = remat in ("none", "everything_saveable")
    gpu = on_gpu(plan) and plan.pipeline is None
    w = largest
    if saves_all:
        working = max(w.every if layers > 1 else 0, 4 * w.f, w.blocks)
    elif gpu and remat == "full" and not any(r.moe for r in model_runs(cfg)):
        # the GPU's fused layer holds the MLP's pieces (fitted on dense models)
        working = max(GPU_FULL_MLP_PIECES * w.f, w.blocks)
    else:
        working = w.every - _kept(w, remat, gathered) + max(2 * w.f, w.blocks)
    working += 2 * w.x
    # A periodic run's row (`models.runs`) is one checkpointed iteration of `period` blocks:
    # its backward also holds each further block's residuals (recomputed, or sliced out of
    # the stacks: copies on XLA CPU), and under `full` only each row's input is kept
    # (fitted on XLA CPU, jax 0.10.2: tiny, 8 layers in (sliding, full) rows, within 4%
    # under none, selective and full).
    further, rows = _periods(plan, layers)
    working += further * w.every
    # Dense attention's causal mask broadcast to [b, kv, group, s, t] booleans: the same in
    # every layer, so XLA hoists it out of the layer loop (inside the checkpoint under a
    # remat policy, rebuilt per layer).
    mask = a.mask if saves_all else 0
    # The loss's backward is done before the first layer's starts: the larger counts.
    # Stashing, besides the held residuals: the forward branch's output, the select that
    # stores it, the backward's read of its slot, and about half a micro-batch's worth of
    # the loss's and XLA's own (fitted on XLA CPU, jax 0.10.2: how closely, in
    # docs/measurements.md#memory-model-fits).
    chunk = (rows if remat == "full" else layers) * per_layer
    weights_read, handover = _for_weights(a, saves_all) if awaiting else (0, 0)
    # Split, hand-overs beside those in slots: the backward branch's output and the weight
    # branch's read of its slot, on the GPU compiler one more (fitted as the 7/2 chunks, on
    # XLA CPU and the H100 compiler, jax 0.10.2; docs/measurements.md#memory-model-fits).
    copies = (3 if on_gpu(plan) else 2) if handed else 0
    stash = layers * ((per_layer - weights_read) * held + weights_read * awaiting
                      + handover * (handed + copies)) + (chunk * 7 // 2 if held else chunk)
    return (stash + max(working, a.loss) + mask
            + expert_grad_sums(plan, micro_batch, seq_len, compute_bytes)
            + (stashed + ticks) * a.x + accumulator + (transposed_stacks(plan) if gpu else 0))


def expert_grad_sums(plan, micro_batch: int, seq_len: int, compute_bytes: int) -> int:
    """Per device, what the backward of a grouped MoE layer under expert parallelism holds
    of its local experts' weight gradients: each piece of the exchange (`--moe-overlap`)
    runs one weight-gradient loop per projection (`models.grouped._gmm_bwd`), summing its
    blocks into float32 zeros of the local experts' shape, and the compiler runs all
    pieces' loops back to back and adds the pieces' gradients after them, so all pieces'
    sums are held at once; beside them, the round's own three gradients in the compute
    dtype. (Not `expert_rounds._rounds_bwd`'s sums, which XLA folds into the first round's
    gradients: starting them there left the 16-expert step at 905.4 MiB.) Read off the
    H100-compiled steps (jax 0.10.2): DeepSeek-V3 on fsdp=8,ep=8 holds twelve f32[32, 7168,
    2048] sums (four pieces) and three such gradients at its peak; a
    16-expert ep=4 step eleven sums and the round's weight-gradient dot in the layer's
    backward. That dot makes one float32 [d, f] gradient per block of its loop iteration
    before they are added in."""
    from jdist.models.grouped import blocks_for
    from jdist.models.moe import GROUPED, even_pieces
    from jdist.parallel.expert_rounds import round_capacity
    from jdist.spmd import axes as ax
    from jdist.spmd.rules import batch_split

    m, cfg = plan.mesh.shape, plan.model
    if not cfg.n_experts or cfg.moe_routing != GROUPED or m[ax.EXPERT] == 1 or \
            not any(r.moe for r in model_runs(cfg)):
        return 0
    # The kernel's tokens on one device (`jdist.parallel.moe.moe_ffn` splits them in pieces).
    tokens = max(1, micro_batch // batch_split(m, plan.rules)[1]) * seq_len // m[ax.SEQUENCE]
    pieces = even_pieces(tokens, overlap_pieces(plan.compute.moe_overlap, plan.mesh))
    n_ep, d, f = m[ax.EXPERT], cfg.d_model, cfg.d_ff // m[ax.TENSOR]
    local = cfg.n_experts // n_ep
    # A round's rows on this device, blocked as `models.grouped.grouped_swiglu` blocks them.
    rows = n_ep * round_capacity(tokens * cfg.top_k // pieces, n_ep)
    shape = blocks_for(rows, local, d * f * compute_bytes)
    # Each piece's d-wide row cotangents, whose zeros are hoisted out of the loop the same
    # way: the rows it received and their blocked copy (`grouped_swiglu`'s gather and the
    # gate/up matmuls' input gradient; four of each at qwen3-30b-a3b ep=8, four and eight
    # at dp=2,ep=2,tp=4, where tensor parallelism leaves them d wide on every rank).
    rows_back = pieces * (rows + shape.n_blocks * shape.block) * cfg.d_model * compute_bytes
    # Beside them, each assignment's output gradient, d wide, split in the pieces (the
    # transpose of their concatenation: four [32768, 2048] at dp=2,ep=2,tp=4).
    assigned = tokens * cfg.top_k * cfg.d_model * compute_bytes
    return 3 * local * d * f * (4 * pieces + compute_bytes) + shape.chunk * d * f * 4 + \
        rows_back + assigned


def _periods(plan, layers: int) -> tuple[int, int]:
    """(blocks in the longest row beyond the first, the rows of stacks that `layers` of the
    model's layers make): a stack's rows are its blocks, a periodic run's its periods."""
    runs = model_runs(plan.model)
    rows = sum(r.rows for r in runs) * layers // plan.model.n_layers
    return max(r.period for r in runs) - 1, rows


def _for_weights(a: _Sizes, saves_all: bool) -> tuple[int, int]:
    """What one layer of a micro-batch holds for a split backward's weight gradients
    (`jdist.parallel.pipeline.split_backward`): the residuals they read, and the input half's
    hand-over. The hand-over: the cotangents of the seven projections' outputs and of the
    two norms' (4x + q + 2k + 2f), and under a policy that recomputes the attention, its
    output. The residuals: the MLP's two hidden activations and the normalised inputs or
    those they are normalised from (2x + 2f), and under `none` (everything_saveable) the
    attention output. (Read off tiny's split under both, and checked against the compiled
    zb-h1 and 1f1b steps on XLA CPU, jax 0.10.2: docs/measurements.md#memory-model-fits.)"""
    residuals = 2 * a.x + 2 * a.f + (a.q if saves_all else 0)
    return residuals, 4 * a.x + a.q + 2 * a.k + 2 * a.f + (0 if saves_all else a.q)


def _grad_bytes(plan, blocks_only: bool = False) -> int:
    """Per device, the float32 gradients of the trained parameters (of the stacked blocks
    only) in their gradient layout."""
    from jdist.models.names import is_blocks

    grads = trainable.select(plan.model, plan.abstract.params)
    shardings = plan.grad_shardings
    if blocks_only:
        grads = {k: v for k, v in grads.items() if is_blocks(k)}
        shardings = {k: shardings[k] for k in grads}
    return per_device_bytes(grads, shardings)


@dataclasses.dataclass
class _Sizes:
    """Per-device bytes of one layer's activations for one micro-batch (compute dtype
    unless said): `x` the residual stream (a block's input, sequence-sharded under
    Megatron SP), `q`/`k` a query/key projection, `f` an MLP hidden activation, `scores`
    dense attention's float32 [b, heads, s, t] score matrix (0 with a blockwise kernel),
    `every` all the residuals the backward of a layer reads (what remat "none" keeps per
    layer), `blocks` a blockwise kernel's score blocks live at once, `mask` dense
    attention's boolean mask, `loss` the loss's own temporaries, `exchanged` what an MoE
    layer's expert all-to-alls delivered (kept by `selective` and `full`), `named_f` the MLP
    hidden activation a policy can name (`f` in a dense layer; in an MoE layer the shared
    expert's alone: the routed experts' matmuls carry no names)."""
    x: int
    q: int
    k: int
    f: int
    scores: int
    every: int
    blocks: int
    mask: int
    loss: int
    exchanged: int = 0
    named_f: int = 0


def _per_layer(plan, micro_batch: int, seq_len: int, c: int) -> tuple[_Sizes, _Sizes]:
    """`_Sizes` of the average layer and of the largest: of a heterogeneous stack's runs
    (`models.runs`: dense blocks, then experts), the average weighted by their layers, so
    that the layers' stacked residuals sum as the runs' do, the largest term by term; both
    the one run's of a homogeneous model."""
    runs = model_runs(plan.model)
    sizes = [dataclasses.astuple(_activations(plan, micro_batch, seq_len, c, r)) for r in runs]
    mean = [sum(r.n_layers * v[i] for r, v in zip(runs, sizes)) // plan.model.n_layers
            for i in range(len(sizes[0]))]
    return _Sizes(*mean), _Sizes(*(max(v) for v in zip(*sizes)))


def _kept(a: _Sizes, remat: str, gathered: int) -> int:
    """What each layer's checkpoint keeps (jdist.models.remat), stacked over the layer scan
    by the forward's loop. The compiler drops what the backward never reads (the last
    projection's output) and keeps XLA's own intermediates of the rest. `gathered`: one
    layer's parameters as gathered (`everything_saveable` keeps them)."""
    kept = {"full": a.x + a.exchanged,
            "selective": a.x + a.q + 2 * a.k + a.x + 2 * a.named_f  # +attention_out, gate, up
            + a.exchanged,
            "dots_with_no_batch_dims_saveable": a.x + a.q + 2 * a.k + a.x + 2 * a.f,
            "dots_saveable": a.x + 2 * a.q + 2 * a.k + a.x + 2 * a.f + a.scores,
            "offload_selective": a.x,  # the projections wait in host memory
            "everything_saveable": a.every + gathered}
    return kept.get(remat, a.every)


def _activations(plan, micro_batch: int, seq_len: int, c: int, run=None) -> _Sizes:
    """`_Sizes` of the plan's layers (of `run`'s, default the first run's) for `micro_batch`
    sequences of `seq_len` tokens, with activations of `c` bytes an element."""
    import math

    from jdist.parallel.attention.context import RING, ULYSSES
    from jdist.spmd import axes as ax
    from jdist.spmd.rules import batch_split, mesh_axes_of, resolve

    m, cfg = plan.mesh.shape, plan.model
    run = run or model_runs(cfg)[0]
    tp, cp = m[ax.TENSOR], m[ax.SEQUENCE]
    b = max(1, micro_batch // batch_split(m, plan.rules)[1])
    s = seq_len // cp
    # The residual stream as the rules lay it out: its length split over `sequence`
    # (context parallel) and, under Megatron SP, `tensor` too.
    spec = tuple(resolve((ax.BATCH, ax.LENGTH, ax.ACT_EMBED), plan.rules, plan.mesh))
    split = math.prod(m[a] for a in mesh_axes_of(spec[1] if len(spec) > 1 else None))
    sp = max(1, split // cp)
    d, f, hd = cfg.d_model, run.d_ff // tp, cfg.dim_per_head
    heads, kv = cfg.n_heads // tp, max(1, cfg.n_kv_heads // tp)
    tokens = b * s
    x = tokens * d * c // sp
    q, k, hidden = tokens * heads * hd * c, tokens * kv * hd * c, tokens * f * c
    dispatch, named = 0, hidden  # what a policy can name: in an MoE layer, its shared expert's
    if run.moe:  # each expert row of the routing path holds a hidden activation
        named = tokens * (cfg.shared_d_ff // tp) * c
        rows = cfg.top_k * expert_factor(cfg, tokens, m[ax.EXPERT],
                                         overlap_pieces(plan.compute.moe_overlap, plan.mesh))
        hidden = int(hidden * rows)
        # and, d wide, the rows the experts read (blocked in expert order, or the padded
        # buffers) and each assignment's output, which the router-weighted sum's backward
        # reads (the GPU-compiled forward loop's saved stacks, qwen3-30b-a3b ep=8).
        dispatch = int(tokens * d * c * (rows + cfg.top_k))
    scores = b * heads * s * seq_len * 4
    attention = _attention(plan, seq_len)
    if attention == "xla":
        # models.layers.dot_product_attention: the float32 softmax's exponentials and its
        # probabilities [b, kv, group, s, t].
        kept, blocks, mask = 2 * scores, 0, b * heads * s * seq_len
    else:
        # flash / context-parallel kernels save q, k, v, the float32 output and the
        # row log-sum-exp (jdist.parallel.attention.flash._fwd); their backward recomputes one
        # [Q_TILE, KEY_TILE] block at a time, its float32 probabilities and their gradient
        # live together (jdist.parallel.attention.blockwise.block_grads).
        sq, heads_k = s, heads
        if plan.compute.cp_strategy == ULYSSES and cp > 1:  # all-to-all: every query, heads / cp
            sq, heads_k = seq_len, max(1, heads // cp)
        t = s if cp > 1 and plan.compute.cp_strategy == RING else seq_len  # ring: a peer's keys
        kept = tokens * heads * hd * 4 + b * heads * s * 4
        blocks = 0 if attention == "cudnn" else \
            2 * b * heads_k * min(sq, Q_TILE) * min(t, KEY_TILE) * 4
        scores = mask = 0  # no dense score matrix: nothing for dots_saveable to keep
    # Per layer, what the backward reads (XLA CPU, remat none): the block input and the
    # attention sum h (x), each RMSNorm's float32 normalized input (sequence-sharded like
    # x) and its output as the projections read it (gathered over tensor under SP); the
    # rotated q and k, v, the attention context; silu's pieces for SwiGLU (gate, up,
    # sigmoid(gate), its derivative, silu(gate), silu(gate) * up).
    normed = tokens * d * 4 // sp
    every = 2 * x + 2 * normed + 2 * tokens * d * c + 2 * q + 2 * k + kept + 6 * hidden + dispatch
    logits = tokens * (cfg.vocab_size // tp) * 4 * 2                # float32 logits + grad
    if plan.compute.loss == CHUNKED:  # a few [tokens, chunk] float32 blocks, dh in float32
        chunk = chunk_size(tokens, cfg.vocab_size // tp)
        logits = tokens * chunk * 4 * 3 + tokens * d * 4
    return _Sizes(x, q, k, hidden, scores, every, blocks, mask, logits,
                  _exchanged(plan, tokens, c) if run.moe else 0, named)


def _exchanged(plan, tokens: int, c: int) -> int:
    """Per device and MoE layer, what its expert all-to-alls delivered, which `selective`
    and `full` keep (`jdist.models.remat.EXPERT_EXCHANGE`) for `tokens` tokens of `c`-byte
    activations: grouped, each piece's first-round rows (d wide) and their int32 expert ids
    at this device's experts (`jdist.parallel.expert_rounds`), and each assignment's output
    back; padded, the [E, capacity, d] buffers at the experts and their outputs back."""
    from jdist.models.moe import DROPLESS, GROUPED, capacity_of, even_pieces
    from jdist.parallel.expert_rounds import round_capacity
    from jdist.spmd import axes as ax

    cfg, n_ep = plan.model, plan.mesh.shape[ax.EXPERT]
    if n_ep == 1:
        return 0
    d, k = cfg.d_model, cfg.top_k
    if cfg.moe_routing == GROUPED:
        pieces = even_pieces(tokens, overlap_pieces(plan.compute.moe_overlap, plan.mesh))
        rows = pieces * n_ep * round_capacity(tokens * k // pieces, n_ep)
        return rows * (d * c + 4) + tokens * k * d * c
    return 2 * cfg.n_experts * capacity_of(tokens, cfg, cfg.moe_routing == DROPLESS) * d * c


def _attention(plan, seq_len: int) -> str:
    from jdist.step.forward import attention_of
    return attention_of(plan, seq_len)


def predict(plan, micro_batch: int, seq_len: int, state: tuple[int, ...] | None = None) -> \
        Breakdown:
    """The analytical plan, from shapes and shardings alone (nothing compiled); the compute
    dtype and remat policy are the plan's. `state` is `state_bytes(plan)` when already known
    (it does not change with remat, accumulation, attention or the pipeline schedule)."""
    params, grads, optimizer, in_flight = state or state_bytes(plan)
    backward = in_flight + activation_bytes(plan, micro_batch, seq_len,
                                            plan.compute.dtype.itemsize, plan.compute.remat) \
        + stage_gathered_bytes(plan)
    # After the backward, the optimizer update holds one more float32 tree the size of the
    # gradients on XLA CPU: optax.clip_by_global_norm scales every leaf into a new buffer
    # (AdamW's moments and the parameters are then updated in place, the state being
    # donated). XLA's GPU compiler fuses that scaling into the update: no such tree (full
    # fine-tuning of 1B/8B/70B on one H100 target, jax 0.10.2).
    # Muon's update also holds its owned matrices whole (`jdist.step.muon_cost.update_bytes`).
    # `--offload params` updates on the host (`jdist.step.host_update`), Muon's on the
    # device a chunk of layers at a time (`jdist.step.device_walk`).
    update = device_walk.device_bytes(plan) if plan.streams else \
        (0 if on_gpu(plan) else grads) + muon_cost.update_bytes(
            plan.abstract.opt_state, plan.opt_device_shardings, dict(plan.mesh.shape),
            plan.names)
    if plan.on_disk:  # `--offload disk`: a group of layers at a time (`disk_update`)
        update = disk_update.update_bytes(plan)
    return Breakdown(params, grads, optimizer, max(backward, update))


def stage_gathered_bytes(plan) -> int:
    """Pipelined, the shared leaves stored split over `stage` (`jdist.parallel.pipeline.shared`)
    are held whole over it for the step, as stored (float32), and a trained one's gradient
    accumulates whole over it until the reduce-scatter after the ticks."""
    from jax.sharding import NamedSharding

    from jdist.models.names import is_blocks
    from jdist.parallel.pipeline.shared import stage_dim
    from jdist.spmd import axes as ax

    if plan.pipeline is None:
        return 0
    trained = trainable.select(plan.model, plan.abstract.params)
    total = 0
    for key, leaf in plan.abstract.params.items():
        sharding = plan.shardings.params[key]
        if is_blocks(key) or not isinstance(sharding, NamedSharding) or \
                stage_dim(sharding) is None:
            continue
        copies = 2 if trained.get(key) is not None else 1
        total += copies * _gathered(leaf, sharding, None, (ax.STAGE,))
    return total


def on_gpu(plan) -> bool:
    """Whether the plan's step compiles for NVIDIA GPUs (real or a deviceless target)."""
    return plan.mesh.devices.flat[0].platform == "gpu"


def state_bytes(plan) -> tuple[int, int, int, int]:
    """Per device: parameters, gradients, optimizer state, and what the per-layer gradient
    path holds in flight (`in_flight_bytes`)."""
    params = per_device_bytes(plan.abstract.params, plan.shardings.params)
    # Gradients of the trained parameters only (with LoRA: the adapters).
    grads = per_device_bytes(trainable.select(plan.model, plan.abstract.params),
                             plan.grad_shardings)
    optimizer = 0 if plan.offload or plan.on_disk else per_device_bytes(plan.abstract.opt_state,
                                                        plan.shardings.opt_state)
    in_flight = in_flight_bytes(plan, plan.compute.dtype.itemsize)
    if plan.streams:  # --offload params: all three live in host memory, but gradients
        # that accumulate (pipeline ticks, micro-batches) do so on the device
        return 0, 0 if plan.grads_stream else grads, 0, in_flight + streamed_bytes(plan)
    return params, grads, optimizer, in_flight


def streamed_bytes(plan) -> int:
    """What `--offload params` brings to the device besides what every layout gathers
    (`in_flight_bytes`): the shared parameters (embedding, final norm, head) as stored and
    their float32 gradients until they go back, and two layers' stored blocks (the one
    computing and the one coming in: `jdist.parallel.prefetch.run`; of the largest run's)."""
    params, shardings = plan.abstract.params, plan.shardings.params
    runs = model_runs(plan.model)
    keys = {r.key for r in runs}
    shared = per_device_bytes({k: v for k, v in params.items() if k not in keys},
                              {k: v for k, v in shardings.items() if k not in keys})
    layer = max(per_device_bytes(params[r.key], shardings[r.key]) // r.rows for r in runs)
    return 2 * shared + 2 * layer


def in_flight_bytes(plan, compute_bytes: int) -> int:
    """What the per-layer gradient path holds besides the state (jdist.parallel.grad_sync):
    one layer's parameters gathered over the replica axes (compute dtype), the float32
    gradient of one of its leaves before the reduction (each leaf's is reduced as the
    backward produces it: the largest counts), and the shared parameters the step gathers
    whole (none with an untied table and the chunked loss) with their full float32
    gradients."""
    from jdist.models.names import EMBED, HEAD

    params, grad = _gathered_layer(plan, compute_bytes)
    # An untied table is looked up where it lies (jdist.parallel.embedding), never gathered;
    # the chunked loss gathers the output weight a chunk at a time (jdist.parallel.vocab).
    skip = {r.key for r in model_runs(plan.model)} | \
        (set() if plan.model.tie_embeddings else {EMBED})
    if plan.compute.loss == CHUNKED:
        skip |= {EMBED if plan.model.tie_embeddings else HEAD}
    shared = {k: v for k, v in plan.abstract.params.items() if k not in skip}
    shared_sh = {k: v for k, v in plan.shardings.params.items() if k not in skip}
    # Frozen (LoRA): gathered in their storage dtype, without a gradient.
    frozen = trainable.frozen_base(plan.model)
    # The prefetching loop holds the next layer's gathered parameters beside this one's.
    ahead = params if prefetches(plan) else 0
    # `--fp8`: the layer's weights quantized for the forward and again for the input
    # gradient (rowwise: scaled per output column, then per input row), a byte each
    # (checked against the H100-compiled step: docs/measurements.md#memory-model-fits).
    quantized = 2 * (params // compute_bytes) if plan.compute.fp8 != "off" else 0
    return params + ahead + quantized + grad \
        + _gathered(shared, shared_sh, None if frozen else 4 + 4) + _table_scatter(plan)


def prefetches(plan) -> bool:
    """Whether the step's layer loops gather one layer ahead (`jdist.parallel.prefetch`):
    over all layers, or a pipeline chunk's."""
    import jax

    from jdist.parallel import prefetch
    from jdist.spmd import axes as ax
    from jdist.step.grads import block_syncs, syncs

    layers = max(r.rows for r in model_runs(plan.model))  # the longest run's loop
    if plan.pipeline is not None:
        layers //= plan.pipeline.table(plan.mesh.shape[ax.STAGE]).chunks
    return prefetch.applies(plan.compute.prefetch, plan.mesh,
                            jax.tree.leaves(block_syncs(syncs(plan))), layers)


def _table_scatter(plan) -> int:
    """The lookup's backward scatter-adds rows into a float32 zeros block of the table as
    stored (jdist.parallel.embedding.Table.scatter), allocated before the layers' backward.
    A tied table's sits beside the loss's gradient of the same weight (that one counted in
    the gradients); an untied one's is its gradient, bigger only where ZeRO-2 reduces it
    to a smaller block."""
    from jdist.models.names import EMBED

    if trainable.select(plan.model, plan.abstract.params).get(EMBED) is None:
        return 0  # frozen: no gradient
    table = plan.abstract.params[EMBED]
    stored = per_device_bytes(table, plan.shardings.params[EMBED], 4)
    if plan.model.tie_embeddings:
        return stored
    return stored - per_device_bytes(table, plan.grad_shardings[EMBED], 4)


def _gathered(tree, shardings, itemsize: int | None, axes: tuple[str, ...] = ()) -> int:
    """Per-device bytes of `tree` as laid out, less the mesh `axes` (gathered there; default:
    the replica axes)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jdist.spmd import axes as ax
    from jdist.spmd.rules import without_axis

    def strip(s):
        spec = tuple(s.spec)
        for a in axes or ax.REPLICA_AXES:
            spec = tuple(c for _, c in without_axis(tuple(("", e) for e in spec), a))
        return NamedSharding(s.mesh, PartitionSpec(*spec))
    return per_device_bytes(tree, jax.tree.map(strip, shardings), itemsize)


def transposed_stacks(plan) -> int:
    """Per device, the stored block stacks XLA's GPU compiler copies whole, transposed,
    once per step (found on jax 0.10.2, H100 target): a leaf gathered over replica axes
    on a dimension other than its first (the embed dimension of `w_down` and `wo` under
    fsdp) is gathered with that dimension made major, and layout assignment moves the
    transposition out of the layer loop onto the whole stack as stored (float32)."""
    import jax

    from jdist.parallel.grad_sync import manual_part
    from jdist.step.grads import MANUAL

    keys = [r.key for r in model_runs(plan.model)]
    blocks = [plan.abstract.params[k] for k in keys]
    shardings = jax.tree.leaves([plan.shardings.params[k] for k in keys],
                                is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    # Per dimension of the stack, the replica axes it is split on: [0] is `layers`, [1]
    # the one a gather can concatenate along without a transposition.
    return sum(per_device_bytes(leaf, sh) for leaf, sh in zip(jax.tree.leaves(blocks), shardings)
               if any(manual_part(sh.spec, leaf.ndim, MANUAL)[2:]))


def _gathered_layer(plan, compute_bytes: int) -> tuple[int, int]:
    """Per device, one layer's parameters as the layer loop gathers them for compute
    (`grad_sync.gather`), and the float32 gradient of its largest trained leaf."""
    import jax

    from jdist.spmd import axes as ax

    stages = plan.mesh.shape[ax.STAGE] if plan.pipeline is not None else 1
    params, grad = 0, 0
    for run in model_runs(plan.model):  # one layer at a time: the largest run's counts
        layers = run.rows // stages  # a pipeline stage holds its share (a row: a period)
        parts = _layer_parts(plan, compute_bytes, run.key)
        params = max(params, sum(_gathered(*part) for part in parts) // layers)
        trained, shardings, _ = parts[0]
        grad = max(grad, max((_gathered(leaf, s, 4) for leaf, s in zip(
            jax.tree.leaves(trained),
            jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))),
            default=0) // layers)
    return params, grad


def _layer_parts(plan, compute_bytes: int, key: str):
    """(abstract, shardings, bytes per element) of what one layer loop iteration holds of
    the stacked blocks, summed over all layers: trained leaves gathered in the compute
    dtype (first); frozen ones gathered in their storage dtype; NF4 ones gathered as
    stored, plus their weights dequantized in the compute dtype."""
    import jax

    from jdist.quant import nf4

    blocks, shardings = plan.abstract.params[key], plan.shardings.params[key]
    is_nf4 = lambda x: isinstance(x, nf4.Nf4)
    trained = trainable.select(plan.model, blocks)
    if trained is blocks:  # everything is trained
        return [(blocks, shardings, compute_bytes)]
    frozen = jax.tree.map(lambda t, b: b if t is None else None, trained, blocks,
                          is_leaf=lambda x: x is None or is_nf4(x))
    weights = jax.tree.map(lambda q: jax.ShapeDtypeStruct(
        (*q.codes.shape[:-1], 2 * q.codes.shape[-1]), q.codes.dtype) if is_nf4(q) else None,
        frozen, is_leaf=is_nf4)
    codes_sh = jax.tree.map(lambda s, q: s.codes if is_nf4(q) else None, shardings, frozen,
                            is_leaf=is_nf4)
    drop = lambda tree: jax.tree.map(lambda x: x, tree)  # None leaves vanish
    return [(drop(trained), drop(trainable.select(plan.model, shardings)), compute_bytes),
            (drop(frozen), _prefix(frozen, shardings), None),
            (drop(weights), drop(codes_sh), compute_bytes)]


def _prefix(part, full):
    """The leaves of `full` (shardings) under the leaves `part` holds (not None)."""
    import jax
    leaves = []
    jax.tree.map(lambda p, f: leaves.append(f) if p is not None else None, part, full,
                 is_leaf=lambda x: x is None)
    return leaves


def lower_step(plan, batch_size: int, seq_len: int):
    """The training step lowered on abstract inputs (nothing allocated), ready to compile
    (with the target's options: `jdist.step.build.compiler_options`)."""
    import jax
    import jax.numpy as jnp

    from jdist.step.build import make_train_step

    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return make_train_step(plan).lower(placed(plan), {"inputs": tokens, "targets": tokens})


def placed(plan):
    """The abstract state with its shardings: jit's in_shardings alone do not give an
    abstract input its memory space (jax 0.10.2), which `--offload params`'s layer loop
    matches its gradients to."""
    import jax

    if not plan.streams:
        return plan.abstract
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        plan.abstract, plan.shardings)


def compile_step(plan, batch_size: int, seq_len: int, breakdown: list | None = None):
    """The training step compiled ahead of time on abstract inputs (nothing allocated).
    A `breakdown` list receives the compiler's account of the peak (`jdist.memory.breakdown`)."""
    from jdist.step.build import compiler_options

    lowered = lower_step(plan, batch_size, seq_len)
    if breakdown is None:
        return lowered.compile(compiler_options(plan) or None)
    from jdist.memory.breakdown import compile_with_breakdown

    compiled, lines = compile_with_breakdown(lowered, compiler_options(plan))
    breakdown.extend(lines)
    return compiled


def compile_and_measure(plan, batch_size: int, seq_len: int,
                        breakdown: list | None = None) -> tuple[object, Breakdown]:
    """`compile_step` and `measure`, saying on stderr what compiles: a 70B's step takes
    minutes for a GPU target, and its gradients compile again on their own."""
    from jdist.tools import progress

    where = f"{plan.mesh.devices.size} x {plan.mesh.devices.flat[0].device_kind}"
    with progress.phase(f"compiling the step for {where}", "compiled the step"):
        compiled = compile_step(plan, batch_size, seq_len, breakdown)
    with progress.phase("compiling the gradients alone, to measure them",
                        "compiled the gradients"):
        return compiled, measure(plan, batch_size, seq_len, compiled)


def measure(plan, batch_size: int, seq_len: int, compiled=None) -> Breakdown:
    """The compiler's per-device bytes for the real training step, compiled ahead of time
    on abstract inputs. Parameters and optimizer state are the step's arguments (split by
    the compiled input layout); gradients are the output of the compiled gradient
    computation; activations are the step's temporaries minus those gradients."""
    import jax
    import jax.numpy as jnp

    from jdist.step.build import compiler_options, gradients

    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}
    compiled = compiled or compile_step(plan, batch_size, seq_len)
    stats = compiled.memory_analysis()
    grads_fn = jax.jit(lambda params, batch: gradients(plan, params, batch)[2],
                       in_shardings=(plan.shardings.params, batch_sh),
                       out_shardings=plan.grad_shardings)
    grads = grads_fn.lower(placed(plan).params, batch).compile(
        compiler_options(plan) or None).memory_analysis()

    arguments = stats.argument_size_in_bytes + stats.host_argument_size_in_bytes
    batch_bytes = per_device_bytes(batch, batch_sh)
    params = per_device_bytes(plan.abstract.params, plan.shardings.params)
    optimizer = arguments - params - batch_bytes - 4  # the int32 step counter
    if plan.offload:
        optimizer = 0  # between steps it lives in host memory
    grad_bytes = grads.output_size_in_bytes
    if plan.streams:  # host memory too (the CPU compiler counts host buffers as its own)
        params = grad_bytes = 0
    return Breakdown(params, grad_bytes, optimizer,
                     max(0, stats.temp_size_in_bytes - grads.output_size_in_bytes))


def peak(compiled) -> int:
    """Per-device peak of a compiled step: arguments (device memory), outputs not aliased
    to them, and temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes \
        + m.temp_size_in_bytes


def gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB" if n >= 2**26 else f"{n / 2**20:10.3f} MiB"


def table(predicted: Breakdown, measured: Breakdown | None = None) -> str:
    rows = [f"{'per device':12} {'predicted':>14}" + (f" {'measured':>14} {'ratio':>7}"
                                                       if measured else "")]
    for key in (*COMPONENTS, "total"):
        p = predicted.as_dict()[key]
        line = f"{key:12} {gib(p):>14}"
        if measured:
            m = measured.as_dict()[key]
            line += f" {gib(m):>14} {m / p if p else float('nan'):7.3f}"
        rows.append(line)
    return "\n".join(rows)
