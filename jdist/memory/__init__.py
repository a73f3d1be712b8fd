"""Per-device memory: an analytical plan, and what the compiler actually allocates.

The plan makes mixed-precision Adam's accounting explicit, per device:
  parameters   float32 master weights, sharded as the ZeRO stage says (+ a bf16 compute copy
               when --compute-dtype bfloat16)
  gradients    float32, replicated over data until ZeRO-2 shards them
  optimizer    two float32 Adam moments, sharded over data from ZeRO-1 (on the host with
               --offload optimizer)
  activations  what the backward pass keeps, by --remat policy, for one micro-batch, plus
               transient full gradients before their reduce-scatter (ZeRO-2/3); pipelined,
               the schedule's stashed chunk inputs and one chunk's recomputation

`python -m jdist.memory --model 7b --mesh fsdp=8 --zero 3 [--measure] [--json]` prints it
(`jdist/memory/__main__.py`); `--measure` compiles the real step ahead of time on abstract
inputs (nothing allocated) and reads `compiled.memory_analysis()`. The fit check a run
makes before it starts lives in `jdist.train.fit`.
"""

from __future__ import annotations

import dataclasses

from jdist.loss import CHUNKED
from jdist.parallel.blockwise import KEY_TILE, Q_TILE
from jdist.parallel.vocab import chunk_size
from jdist.sharding import per_device_bytes
from jdist.train import trainable

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


def activation_bytes(plan, micro_batch: int, seq_len: int, compute_bytes: int,
                     remat: str) -> int:
    """Bytes the backward pass needs from the forward, per device, for one micro-batch.
    Pipelined, a stage holds its schedule's stashed chunk inputs and cotangents (one
    pipeline micro-batch each) and recomputes one chunk of layers at a time."""
    from jdist import axes as ax

    m, cfg = plan.mesh.shape, plan.model
    tp = m[ax.TENSOR]
    layers, stashed = cfg.n_layers, 0
    if plan.pipeline is not None:
        table = plan.pipeline.table(m[ax.STAGE])
        micro_batch, layers = micro_batch // table.micro, cfg.n_layers // table.chunks
        stashed = table.n_slots + table.n_grad_slots
    b = max(1, micro_batch // (m[ax.DATA] * m[ax.FSDP] * m[ax.EXPERT]))  # batch's axes
    s = seq_len // m[ax.SEQUENCE]
    d, f, hd = cfg.d_model, cfg.d_ff // tp, cfg.dim_per_head
    heads, kv = cfg.n_heads // tp, max(1, cfg.n_kv_heads // tp)
    tokens = b * s
    residual = tokens * d * compute_bytes                           # a block's input
    matmuls = tokens * ((heads + 2 * kv) * hd + d + 3 * f + d) * compute_bytes
    elementwise = tokens * (2 * d + heads * hd + f) * compute_bytes  # norms, context, silu
    scores = b * heads * s * seq_len * 4 * 2                        # float32 scores + probs
    if _attention(plan, seq_len) != "xla":  # blockwise: [Q_TILE, KEY_TILE] blocks, O(S) stats
        scores = b * heads * (min(s, Q_TILE) * min(seq_len, KEY_TILE) * 4 * 3 + s * 4 * 3)
    per_layer = {"none": matmuls + elementwise + scores + residual,
                 "everything_saveable": matmuls + elementwise + scores + residual,
                 "full": residual,
                 "selective": residual + matmuls,
                 "dots_saveable": residual + matmuls + b * heads * s * seq_len * compute_bytes,
                 "dots_with_no_batch_dims_saveable": residual + matmuls,
                 "offload_selective": residual}.get(remat, residual + matmuls)
    recompute = 0 if remat in ("none", "everything_saveable") else \
        matmuls + elementwise + scores  # one block rematerialised at a time
    logits = tokens * (cfg.vocab_size // tp) * 4 * 2                # float32 logits + grad
    if plan.loss == CHUNKED:  # a few [tokens, chunk] float32 blocks, dh in float32
        chunk = chunk_size(tokens, cfg.vocab_size // tp)
        logits = tokens * chunk * 4 * 3 + tokens * d * 4
    return layers * per_layer + recompute + logits + stashed * residual


def _attention(plan, seq_len: int) -> str:
    from jdist.train.context import attention_of
    return attention_of(plan, seq_len)


def predict(plan, micro_batch: int, seq_len: int, state: tuple[int, ...] | None = None) -> \
        Breakdown:
    """The analytical plan, from shapes and shardings alone (nothing compiled); the compute
    dtype and remat policy are the plan's. `state` is `state_bytes(plan)` when already known
    (it does not change with remat, accumulation, attention or the pipeline schedule)."""
    params, grads, optimizer, in_flight = state or state_bytes(plan)
    return Breakdown(params, grads, optimizer, in_flight + activation_bytes(
        plan, micro_batch, seq_len, plan.compute_dtype.itemsize, plan.remat))


def state_bytes(plan) -> tuple[int, int, int, int]:
    """Per device: parameters, gradients, optimizer state, and what the per-layer gradient
    path holds in flight (`in_flight_bytes`)."""
    params = per_device_bytes(plan.abstract.params, plan.shardings.params)
    # Gradients of the trained parameters only (with LoRA: the adapters).
    grads = per_device_bytes(trainable.select(plan.model, plan.abstract.params),
                             plan.grad_shardings)
    optimizer = 0 if plan.offload else per_device_bytes(plan.abstract.opt_state,
                                                        plan.shardings.opt_state)
    return params, grads, optimizer, in_flight_bytes(plan, plan.compute_dtype.itemsize)


def in_flight_bytes(plan, compute_bytes: int) -> int:
    """What the per-layer gradient path holds besides the state (jdist.parallel.grad_sync):
    one layer's parameters gathered over the replica axes (compute dtype) and its float32
    gradient before the reduction, and the shared parameters the step gathers whole (none
    with an untied table and the chunked loss) with their full float32 gradients."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jdist import axes as ax
    from jdist.rules import without_axis
    from jdist.train.layer_order import BLOCKS, EMBED, HEAD

    def gathered(tree, shardings, itemsize):  # as laid out, less the replica axes
        def strip(s):
            spec = tuple(s.spec)
            for a in ax.REPLICA_AXES:
                spec = tuple(c for _, c in without_axis(tuple(("", e) for e in spec), a))
            return NamedSharding(s.mesh, PartitionSpec(*spec))
        return per_device_bytes(tree, jax.tree.map(strip, shardings), itemsize)

    layers = plan.model.n_layers  # a pipeline stage holds its share of them
    if plan.pipeline is not None:
        layers //= plan.mesh.shape[ax.STAGE]
    layer = sum(gathered(*part) for part in _layer_parts(plan, compute_bytes)) // layers
    # An untied table is looked up where it lies (jdist.parallel.embedding), never gathered;
    # the chunked loss gathers the output weight a chunk at a time (jdist.parallel.vocab).
    skip = {BLOCKS} | (set() if plan.model.tie_embeddings else {EMBED})
    if plan.loss == CHUNKED:
        skip |= {EMBED if plan.model.tie_embeddings else HEAD}
    shared = {k: v for k, v in plan.abstract.params.items() if k not in skip}
    shared_sh = {k: v for k, v in plan.shardings.params.items() if k not in skip}
    # Frozen (LoRA): gathered in their storage dtype, without a gradient.
    frozen = trainable.frozen_base(plan.model)
    return layer + gathered(shared, shared_sh, None if frozen else 4 + 4)


def _layer_parts(plan, compute_bytes: int):
    """(abstract, shardings, bytes per element) of what one layer loop iteration holds of
    the stacked blocks, summed over all layers: trained leaves gathered in the compute
    dtype with their float32 gradient; frozen ones gathered in their storage dtype; NF4
    ones gathered as stored, plus their weights dequantized in the compute dtype."""
    import jax

    from jdist import nf4
    from jdist.train.layer_order import BLOCKS

    blocks, shardings = plan.abstract.params[BLOCKS], plan.shardings.params[BLOCKS]
    is_nf4 = lambda x: isinstance(x, nf4.Nf4)
    trained = trainable.select(plan.model, blocks)
    if trained is blocks:  # everything is trained
        return [(blocks, shardings, compute_bytes + 4)]
    frozen = jax.tree.map(lambda t, b: b if t is None else None, trained, blocks,
                          is_leaf=lambda x: x is None or is_nf4(x))
    weights = jax.tree.map(lambda q: jax.ShapeDtypeStruct(
        (*q.codes.shape[:-1], 2 * q.codes.shape[-1]), q.codes.dtype) if is_nf4(q) else None,
        frozen, is_leaf=is_nf4)
    codes_sh = jax.tree.map(lambda s, q: s.codes if is_nf4(q) else None, shardings, frozen,
                            is_leaf=is_nf4)
    drop = lambda tree: jax.tree.map(lambda x: x, tree)  # None leaves vanish
    return [(drop(trained), drop(trainable.select(plan.model, shardings)), compute_bytes + 4),
            (drop(frozen), _prefix(frozen, shardings), None),
            (drop(weights), drop(codes_sh), compute_bytes)]


def _prefix(part, full):
    """The leaves of `full` (shardings) under the leaves `part` holds (not None)."""
    import jax
    leaves = []
    jax.tree.map(lambda p, f: leaves.append(f) if p is not None else None, part, full,
                 is_leaf=lambda x: x is None)
    return leaves


def compile_step(plan, batch_size: int, seq_len: int):
    """The training step compiled ahead of time on abstract inputs (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from jdist.train.step import make_train_step

    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    step = make_train_step(plan)
    return step.lower(plan.abstract, {"inputs": tokens, "targets": tokens}).compile()


def measure(plan, batch_size: int, seq_len: int, compiled=None) -> Breakdown:
    """The compiler's per-device bytes for the real training step, compiled ahead of time
    on abstract inputs. Parameters and optimizer state are the step's arguments (split by
    the compiled input layout); gradients are the output of the compiled gradient
    computation; activations are the step's temporaries minus those gradients."""
    import jax
    import jax.numpy as jnp

    from jdist.train.step import gradients

    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    batch_sh = {"inputs": plan.batch_sharding, "targets": plan.batch_sharding}
    compiled = compiled or compile_step(plan, batch_size, seq_len)
    stats = compiled.memory_analysis()
    grads_fn = jax.jit(lambda params, batch: gradients(plan, params, batch)[2],
                       in_shardings=(plan.shardings.params, batch_sh),
                       out_shardings=plan.grad_shardings)
    grads = grads_fn.lower(plan.abstract.params, batch).compile().memory_analysis()

    arguments = stats.argument_size_in_bytes + stats.host_argument_size_in_bytes
    batch_bytes = per_device_bytes(batch, batch_sh)
    params = per_device_bytes(plan.abstract.params, plan.shardings.params)
    optimizer = arguments - params - batch_bytes - 4  # the int32 step counter
    if plan.offload:
        optimizer = 0  # between steps it lives in host memory
    return Breakdown(params, grads.output_size_in_bytes, optimizer,
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
