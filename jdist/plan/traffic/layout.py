"""The step as one device of the plan's mesh sees it: sizes, parameter leaves, activation
layouts, and the `Collective` every traffic function returns. Read off the plan's rules,
shardings and `jdist.parallel.grad_sync` syncs; nothing here is fitted to a compiler."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from jdist.models.names import EMBED, HEAD, is_blocks
from jdist.models.runs import runs
from jdist.parallel import collective_matmul
from jdist.parallel.grad_sync import Sync
from jdist.parallel.pipeline.shared import stage_dim
from jdist.spmd import axes as ax
from jdist.spmd import sharding as sh
from jdist.spmd.rules import mesh_axes_of, resolve
from jdist.spmd.zero import zero_dim
from jdist.step import trainable
from jdist.step.forward import context_parallel_of, inner_rules
from jdist.step.grads import MANUAL, syncs
from jdist.tools.hlo import COLLECTIVES

AR, AG, RS, PERMUTE, A2A = COLLECTIVES
F32, S32 = "f32", "s32"
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u8": 1, "s8": 1}
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8", "int8": "s8",
             "int32": "s32"}
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
    zero_split: bool         # ZeRO-1/2 split its optimizer state over data (jdist.spmd.zero)
    stages: int = 1          # ways `stage` splits a shared leaf between steps (stage_shared)

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
    collective_matmul: bool = False  # SP's activations by parallel.collective_matmul
    run: object = None       # a `models.runs.Run`: the layers modelled are that run's

    @property
    def model(self):
        return self.plan.model

    @property
    def moe(self) -> bool:
        """Whether the layers modelled route to experts (the run's, else any of the model's)."""
        return self.run.moe if self.run is not None else bool(self.model.n_experts)

    def runs(self) -> list[Step]:
        """This step once per run of the model's blocks (`models.runs`)."""
        return [dataclasses.replace(self, run=r) for r in runs(self.model)]

    def size(self, axes: Iterable[str]) -> int:
        return math.prod(self.n[a] for a in axes)

    def ways(self, groups: Iterable[Iterable[str]]) -> int:
        """Shards of an array split dimension by dimension over `groups` of axes."""
        return math.prod(self.size(axes) for axes in groups)

    @property
    def tokens(self) -> int:
        """Sequence positions per device in attention (the length split over cp)."""
        return self.seq // self.size(self.cp)

    @property
    def act(self) -> int:
        """Elements of one [rows, tokens, d_model] activation."""
        return self.rows * self.tokens * self.model.d_model

    def blocks(self) -> list[Leaf]:
        """One layer's leaves: of the run modelled, else of every run."""
        return [leaf for leaf in self.leaves if is_blocks(leaf.key) and
                (self.run is None or leaf.key == self.run.key)]

    def leaf(self, key: str) -> Leaf:
        return next(leaf for leaf in self.leaves if leaf.key == key)

    def shared(self) -> list[Leaf]:
        return [leaf for leaf in self.leaves if not is_blocks(leaf.key)]

    @property
    def head(self) -> Leaf:
        """The output weight: the head, or the tied embedding table."""
        return self.leaf(EMBED if self.model.tie_embeddings else HEAD)


def mesh_axes(names: Iterable[str], mesh) -> tuple[str, ...]:
    """The mesh axes (size > 1) among `names`, in mesh order."""
    names = set(names)
    return tuple(a for a in mesh.axis_names if a in names and mesh.shape[a] > 1)


def automatic(spec: Iterable, mesh) -> tuple[str, ...]:
    """The automatic mesh axes (size > 1, not replica axes) of partition spec entries;
    not `stage`, over which a shared leaf is gathered whole for the step
    (`jdist.parallel.pipeline.shared`)."""
    return mesh_axes((a for e in spec for a in mesh_axes_of(e)
                      if a not in (*ax.REPLICA_AXES, ax.STAGE)), mesh)


def resolved(plan, names: tuple[str, ...], dim: int, manual=MANUAL) -> tuple[str, ...]:
    """Mesh axes dimension `dim` of an activation named `names` splits over inside the
    step's shard_map (manual over `manual`)."""
    spec = resolve(names, inner_rules(plan.rules, manual), plan.mesh)
    return mesh_axes(mesh_axes_of(spec[dim]), plan.mesh)


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
        drop = 1 if is_blocks(key) else 0  # a block leaf's layers dimension
        shape = tuple(leaf.shape)
        auto = automatic(tuple(stored.spec)[drop:], mesh)
        groups = tuple(mesh_axes(mesh_axes_of(e), mesh) for e in grad.spec)
        out.append(Leaf(key, math.prod(shape[drop:]), auto, math.prod(mesh.shape[a] for a in auto),
                        sync, trainable.is_trainable(plan.model, path),
                        len(shape) - drop >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating),
                        HLO_DTYPE[jnp.dtype(leaf.dtype).name],
                        tuple(g for g in groups if g), math.prod(stored.shard_shape(shape)),
                        zero_dim(shape, base_sh.spec, names, mesh) is not None,
                        mesh.shape[ax.STAGE] if not is_blocks(key) and
                        stage_dim(stored) is not None else 1))
    return tuple(out)


def step_of(plan, batch_size: int, seq_len: int) -> Step:
    """The sizes and layouts every traffic function reads, from the plan's rules."""
    mesh = plan.mesh
    n = dict(mesh.shape)
    pipelined = plan.pipeline is not None
    micro = plan.pipeline.table(n[ax.STAGE]).micro if pipelined else plan.compute.grad_accum
    manual = PIPE_MANUAL if pipelined else MANUAL
    batch_axes = resolved(plan, (ax.BATCH, ax.LENGTH), 0, ())
    cp = mesh_axes(context_parallel_of(plan, manual).axes, mesh)
    residual = resolved(plan, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED), 1, manual)
    return Step(plan, n, batch_size, seq_len, micro,
                batch_size // math.prod(n[a] for a in batch_axes) // micro,
                HLO_DTYPE[jnp.dtype(plan.compute.dtype).name],
                resolved(plan, (ax.HEADS,), 0, manual), cp,
                tuple(a for a in residual if a not in cp),
                resolved(plan, (ax.BATCH, ax.LENGTH), 0, manual), leaves_of(plan),
                collective_matmul.applies(plan.compute.collective_matmul, mesh,
                                          inner_rules(plan.rules, manual), pipelined))


# ---------------------------------------------------------------------------------------
# The embedding table's and the output weight's layouts (jdist.parallel.embedding, vocab)


def vocab_axes(st: Step, leaf: Leaf, vocab_dim: int) -> tuple[str, ...]:
    """Automatic axes splitting `leaf`'s vocabulary dimension as stored."""
    spec = tuple(st.plan.shardings.params[leaf.key].spec) + (None,) * 2
    return automatic((spec[vocab_dim],), st.plan.mesh)


def embed_split(st: Step) -> tuple[str, ...]:
    """Replica axes splitting the table's embed dimension (the lookup's G)."""
    sync = st.leaf(EMBED).sync
    return mesh_axes(sync.stored[1], st.plan.mesh) if len(sync.stored) > 1 else ()


def lookup_supported(st: Step) -> bool:
    """embedding.supports: the table is looked up where it lies, not gathered whole."""
    sync = st.leaf(EMBED).sync
    return not sync.stored[0] and not sync.grad[0]
