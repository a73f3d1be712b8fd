"""Deviceless GPU compilation (`jdist.runtime.target`): tiny steps of every layout family
compiled by XLA's GPU compiler for 8 x H100, and what the scheduled GPU program must show.

This machine has no GPU: the devices are compile-only, nothing runs, and every assertion
reads the compiled program. What the GPU program shows and the CPU one cannot: cuDNN's
fused attention, and collectives in the dtype they were written in (the CPU backend upcasts
bf16 collectives to f32; the GPU one keeps them, so a gradient reduction written in bf16
shows as bf16 here and nowhere else). Per family, one compile serves every assertion:

- attention: cuDNN's fused-attention custom calls (forward and backward) where attention
  is cuDNN (`auto` must resolve to it on an H100 in bf16), the masked (bias) form for
  packed documents, none where the flash kernel runs (context parallelism);
- the family's own collectives over its mesh axes (`jdist.tools.gpu_report` attributes them):
  SP's reduce-scatter over tensor, the ring's permutes over sequence, the stages' permutes,
  the experts' all-to-alls, ZeRO's gathers and reduce-scatters over data, ...;
- every gradient reduction (all-reduce / reduce-scatter over data or fsdp) in float32,
  while bf16 collectives do exist in the program (so float32 is jdist's choice, not an
  upcast); and the same for the reductions over the other token-splitting axes
  (sequence, expert), which only sum gradients (and the loss);
- no all-gather of a whole embedding table or output head ([vocab, d] / [d, vocab]), but
  over `stage`, where a pipeline stores it split (`jdist.parallel.pipeline.shared`). The
  vocabulary is Llama 3's order of size (VOCAB), so the chunked loss walks the head in
  chunks on a mesh that does not split the vocabulary: a whole-head gather is then a bug,
  not a tiny vocabulary's single chunk.

Every test here needs jax's CUDA plugin (`pip install -e ".[dev,cuda12]"`). Without it they
skip, naming the extra, except where JDIST_REQUIRE_CUDA_PLUGIN=1 (CI): there they fail.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.metadata
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.config import TrainConfig
from jdist.errors import ConfigError
from jdist.generate import KVCache, compiled_step
from jdist.generate.cache import cache_shapes, cache_shardings
from jdist.generate.sample import GREEDY
from jdist.generate.weights import inference_plan
from jdist.memory import compile_step
from jdist.models import get_preset
from jdist.runtime import target
from jdist.spmd import axes as ax
from jdist.spmd.mesh import build_mesh
from jdist.spmd.rules import DEFAULT_RULES, resolve
from jdist.step import trainable
from jdist.step.forward import attention_of
from jdist.step.from_flags import plan_for
from jdist.tools import hlo
from jdist.tools.comm import axes_of
from jdist.tools.gpu_report import executions, step_report

pytestmark = pytest.mark.gpu_compiler

TARGET = "h100-80gb"
VOCAB = 131_072  # two loss chunks of the head where the vocabulary is not split (module doc)
BATCH, SEQ = 8, 128
EOD = 10  # packed documents end at this id (any id of the vocabulary will do)
COMMON = dict(model="tiny", target=TARGET, compute_dtype="bfloat16", batch_size=BATCH,
              seq_len=SEQ, vocab_size=VOCAB)

FMHA = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
FMHA_MASKED = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f(?:16|32|64))\[([\d,]*)\]")
REPLICA_AXES = {"data", "fsdp"}        # the step's replica axes: gradients reduced over them
TOKEN_AXES = {"sequence", "expert"}    # the other axes that split a batch's tokens


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each result array
    times: int                                       # executions per step

    @property
    def dtypes(self) -> set[str]:
        return {dtype for dtype, _ in self.arrays}

    @property
    def elements(self) -> int:
        return sum(math.prod(shape) for _, shape in self.arrays)


def collectives_of(text: str, mesh) -> list[Collective]:
    """Every collective of compiled HLO text with the mesh axes it communicates over."""
    out = []
    for kind, result, rest, times in hlo.executed_collectives(text):
        arrays = tuple((dtype, tuple(int(d) for d in filter(None, dims.split(","))))
                       for dtype, dims in _ARRAY.findall(result))
        axes = axes_of(hlo.device_groups(rest, mesh.devices.size), mesh)
        out.append(Collective(kind, axes, arrays, times))
    return out


@dataclasses.dataclass
class Program:
    """A step compiled for the target, read once for every check."""

    plan: object
    text: str
    collectives: list[Collective]
    calls: collections.Counter  # custom-call targets
    runs: collections.Counter   # custom-call targets by executions per step
    report: object = None       # jdist.tools.gpu_report.GpuReport of a training step

    def rows(self) -> set[tuple[str, tuple[str, ...]]]:
        return {(r.kind, r.axes) for r in self.report.rows}


def read(plan, compiled) -> Program:
    text = compiled.as_text()
    comps = hlo.computations(text)
    times = executions(text, comps)
    runs = collections.Counter()
    for name, body in comps.items():
        for call in _TARGET_RE.findall(body):
            runs[call] += times.get(name, 0)
    return Program(plan, text, collectives_of(text, plan.mesh),
                   collections.Counter(_TARGET_RE.findall(text)), runs)


# ---------------------------------------------------------------------------------------
# The checks: each returns what is wrong with the program ("" when nothing).


def check_attention(p: Program, fam: Family) -> str:
    fmha = {t for t in p.calls if t.startswith("__cudnn$fmha")}
    want = {"cudnn": set(FMHA), "cudnn-masked": set(FMHA_MASKED), "flash": set()}[fam.attention]
    resolved = attention_of(p.plan, SEQ)
    expected = "flash" if fam.attention == "flash" else "cudnn"
    if resolved != expected:
        return f"attention resolves to {resolved!r} on {TARGET}, not {expected!r}"
    if fmha != want:
        return f"fused-attention custom calls {sorted(fmha)}, expected {sorted(want)}"
    return ""


def check_layout_collectives(p: Program, fam: Family) -> str:
    missing = [row for row in fam.expect if row not in p.rows()]
    return f"no {missing} among {sorted(p.rows())}" if missing else ""


def check_gradients_float32(p: Program, fam: Family) -> str:
    """Reductions over data/fsdp (gradients and the loss) carry float32 (and the int32
    count of the loss's targets) only; some of them carry weight gradients (no vacuous
    pass); and the program keeps bf16 collectives (activations, weight gathers), so the
    float32 is the step's, not an upcast."""
    reductions = [c for c in p.collectives if c.kind in ("all-reduce", "reduce-scatter")
                  and set(c.axes) & REPLICA_AXES]
    wrong = [c for c in reductions if not c.dtypes <= {"f32", "s32"}]
    if wrong:
        return f"gradient reductions not in float32: {wrong}"
    if not any(math.prod(s) >= p.plan.model.d_model for c in reductions
               for d, s in c.arrays if d == "f32"):
        return f"no float32 gradient reduction over data/fsdp in {reductions}"
    if not any("bf16" in c.dtypes for c in p.collectives):
        return "no bf16 collective at all: was the program upcast?"
    return ""


def check_token_axis_gradients(p: Program, fam: Family) -> str:
    """All-reduces over sequence/expert only sum gradients (and the loss): float32 too, and
    where the mesh splits tokens over such an axis, weight gradients are among them (no
    vacuous pass). (Activations cross those axes by all-gather, all-to-all and permute;
    all_gather context parallelism's backward reduce-scatters K/V cotangents over sequence,
    in bf16: fine.) Before models.projection, GSPMD summed them in bf16 right after the
    weight-gradient matmuls."""
    sums = [c for c in p.collectives if c.kind == "all-reduce" and set(c.axes) & TOKEN_AXES]
    wrong = [c for c in sums if not c.dtypes <= {"f32", "s32"}]
    if wrong:
        return f"gradient sums over sequence/expert not in float32: {wrong}"
    split = {a for a in TOKEN_AXES if p.plan.mesh.shape.get(a, 1) > 1}
    if split and not any(set(c.axes) & split and math.prod(s) >= p.plan.model.d_model
                         for c in sums for _, s in c.arrays):
        return f"no weight-gradient sum over {sorted(split)} in {sums}"
    return ""


def check_no_table_gather(p: Program, fam: Family) -> str:
    v, d = p.plan.model.vocab_size, p.plan.model.d_model
    # Over `stage` alone: a pipeline reassembles the table it stores split over stages
    # (`jdist.parallel.pipeline.shared`), once per step, where it used to store it whole.
    whole = [c for c in p.collectives if c.kind == "all-gather" and tuple(c.axes) != ("stage",)
             and any(shape in ((v, d), (d, v)) for _, shape in c.arrays)]
    return f"whole embedding table / head all-gathered: {whole}" if whole else ""


def check_frozen_base(p: Program, fam: Family) -> str:
    """LoRA/QLoRA: only the adapters' gradients are reduced (the base's are never formed)."""
    trained = sum(math.prod(x.shape) for x in jax.tree.leaves(
        trainable.select(p.plan.model, p.plan.abstract.params)))
    moved = sum(c.elements * c.times for c in p.collectives
                if c.kind in ("all-reduce", "reduce-scatter") and set(c.axes) & REPLICA_AXES)
    return f"gradient reductions move {moved} elements for {trained} trained parameters" \
        if moved > 4 * trained + 4096 else ""


def check_nf4_gathers(p: Program, fam: Family) -> str:
    """QLoRA: the frozen base is gathered over fsdp as 4-bit codes (uint8), not bf16."""
    codes = [c for c in p.collectives if c.kind == "all-gather" and "u8" in c.dtypes
             and "fsdp" in c.axes]
    return "" if codes else "no uint8 (NF4 codes) all-gather over fsdp"


def check_recompute(p: Program, fam: Family) -> str:
    """Remat: the backward runs each block's forward again, cuDNN attention included (per
    step: twice as many forward calls as backward ones); without, the forward runs once."""
    fwd, bwd = p.runs["__cudnn$fmhaSoftmax"], p.runs["__cudnn$fmhaSoftmaxBackward"]
    want = 1 if p.plan.compute.remat == "none" else 2
    if not bwd or fwd != want * bwd:
        return (f"remat {p.plan.compute.remat!r}: cuDNN attention forward runs {fwd} times per "
                f"step for {bwd} backward runs, not {want}x")
    return ""


BASE_CHECKS = {"attention": check_attention, "layout": check_layout_collectives,
               "gradients": check_gradients_float32, "token-axis gradients":
               check_token_axis_gradients, "table": check_no_table_gather}


@dataclasses.dataclass(frozen=True)
class Family:
    """A layout family: its flags (over COMMON) and what its program must show."""

    name: str
    config: dict
    attention: str                           # cudnn, cudnn-masked (packed) or flash
    expect: tuple = ()                       # (kind, mesh axes) rows the program must have
    extra: tuple = ()                        # more check names (EXTRA_CHECKS)


EXTRA_CHECKS = {"frozen base": check_frozen_base, "nf4": check_nf4_gathers,
                "recompute": check_recompute}

CP_MESH = "dp=2,fsdp=2,sp=2"  # (with tensor too, flash attention compiles three times longer)
FAMILIES = [
    Family("dp-fsdp-tp", dict(mesh="dp=2,fsdp=2,tp=2", attention="cudnn"), "cudnn",
           (("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)),
            ("all-reduce", ("data",)), ("all-reduce", ("tensor",))), extra=("recompute",)),
    Family("sequence-parallel", dict(mesh="fsdp=2,tp=4", sequence_parallel=True,
                                     attention="cudnn"), "cudnn",
           (("reduce-scatter", ("tensor",)), ("all-gather", ("tensor",)),
            ("reduce-scatter", ("fsdp",)))),
    Family("cp-ring", dict(mesh=CP_MESH, attention="flash", cp_strategy="ring"),
           "flash", (("collective-permute", ("sequence",)),)),
    Family("cp-all-gather", dict(mesh=CP_MESH, attention="flash",
                                 cp_strategy="all_gather"), "flash",
           (("all-gather", ("sequence",)), ("reduce-scatter", ("sequence",)))),
    Family("cp-ulysses", dict(mesh=CP_MESH, attention="flash",
                              cp_strategy="ulysses"), "flash",
           (("all-to-all", ("sequence",)),)),
    Family("pp-gpipe", dict(mesh="dp=2,pp=2,tp=2", pp_schedule="gpipe"), "cudnn",
           (("collective-permute", ("stage",)), ("all-reduce", ("data",)))),
    Family("pp-1f1b", dict(mesh="fsdp=2,pp=2,tp=2", pp_schedule="1f1b"), "cudnn",
           (("collective-permute", ("stage",)), ("reduce-scatter", ("fsdp",)))),
    Family("pp-interleaved", dict(mesh="dp=2,pp=2,tp=2", pp_schedule="interleaved",
                                  pp_virtual_stages=2, n_layers=4, microbatches=4), "cudnn",
           (("collective-permute", ("stage",)),)),
    # Inside a pipeline stage the ring shifts K/V by all-gather (jdist.parallel.attention.ring).
    Family("pp-sp", dict(mesh="dp=2,pp=2,sp=2", attention="flash"), "flash",
           (("collective-permute", ("stage",)), ("all-gather", ("sequence",)))),
    Family("moe-ep-dropless", dict(model="moe-tiny", mesh="dp=2,ep=4", moe_routing="dropless"),
           "cudnn", (("all-to-all", ("expert",)),)),
    Family("moe-ep-tp-fsdp-capacity", dict(model="moe-tiny", mesh="fsdp=2,ep=2,tp=2",
                                           moe_routing="capacity"), "cudnn",
           (("all-to-all", ("expert",)), ("reduce-scatter", ("fsdp",)))),
    # Grouped dropless: the experts' hidden units split over tensor sum the mixed tokens.
    Family("moe-grouped-dp-fsdp-tp", dict(model="moe-tiny", mesh="dp=2,fsdp=2,tp=2",
                                          moe_routing="grouped"), "cudnn",
           (("all-reduce", ("tensor",)), ("reduce-scatter", ("fsdp",)))),
    Family("moe-grouped-ep-tp-fsdp", dict(model="moe-tiny", mesh="fsdp=2,ep=2,tp=2",
                                          moe_routing="grouped"), "cudnn",
           (("all-to-all", ("expert",)), ("all-reduce", ("tensor",)))),
    Family("lora-fsdp-pp-tp", dict(mesh="fsdp=2,pp=2,tp=2", lora_rank=4), "cudnn",
           (("collective-permute", ("stage",)),), extra=("frozen base",)),
    # QLoRA needs whole NF4 blocks of 64 in every shard (tests/test_lora.py's shape).
    Family("qlora-dp-fsdp-tp", dict(mesh="dp=2,fsdp=2,tp=2", lora_rank=4, quantize_base="nf4",
                                    double_quant=True, d_model=128, n_heads=2, n_kv_heads=2,
                                    d_ff=256), "cudnn",
           (("all-gather", ("fsdp",)),), extra=("frozen base", "nf4")),
    # ZeRO-1/2 keep parameters replicated over data, so their post-update all-gather over
    # data is of whole parameters: with tensor in the mesh, the table's is [vocab/2, d].
    Family("zero1-accum-remat", dict(mesh="dp=4,tp=2", zero=1, grad_accum=2, remat="full"),
           "cudnn", (("all-gather", ("data",)), ("all-reduce", ("data",))),
           extra=("recompute",)),
    Family("zero2-accum-remat", dict(mesh="dp=4,tp=2", zero=2, grad_accum=2,
                                     remat="selective"), "cudnn",
           (("reduce-scatter", ("data",)), ("all-gather", ("data",))), extra=("recompute",)),
    Family("zero3-accum-remat", dict(mesh="dp=8", zero=3, grad_accum=2, remat="full",
                                     batch_size=16), "cudnn",
           (("all-gather", ("data",)), ("reduce-scatter", ("data",))), extra=("recompute",)),
    Family("packed-cudnn", dict(mesh="dp=2,fsdp=2,tp=2", attention="cudnn", packing="eod"),
           "cudnn-masked", (("reduce-scatter", ("fsdp",)),)),
]


@functools.cache
def _compiled(flags: tuple) -> Program:
    config = {**COMMON, **dict(flags)}
    packed = config.pop("packing", None)
    _, plan, _ = plan_for(TrainConfig.of(**config))
    if packed:  # as jdist.train.setup.prepare does for data with an end-of-document id
        plan = plan.computing(eod_id=EOD)
    assert target.is_compile_only(plan.mesh.devices.flat[0])
    assert plan.mesh.devices.flat[0].device_kind == target.GPUS[TARGET].description
    compiled = compile_step(plan, config["batch_size"], config["seq_len"])
    program = read(plan, compiled)
    program.report = step_report(compiled, plan, config["batch_size"], config["seq_len"])
    return program


def compile_config(config: dict) -> Program:
    """The step of COMMON + `config` compiled for the target, once per test process: a test
    that reads the step of a family's flags reads that family's program (a GPU compile is
    seconds to tens of seconds; jax's compilation cache cannot read GPU programs back here)."""
    return _compiled(tuple(sorted(config.items())))


def compile_family(fam: Family) -> Program:
    return compile_config(fam.config)


def verdict(program: Program, fam: Family) -> None:
    """Every check; any failure fails the test."""
    checks = {**BASE_CHECKS, **{name: EXTRA_CHECKS[name] for name in fam.extra}}
    failed = {name: why for name, check in checks.items() if (why := check(program, fam))}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_gpu_program(fam):
    program = compile_family(fam)
    rep = program.report  # the GPU report reads every family's program
    # Executed matmul FLOPs (cuDNN attention, loops weighted) near the model's: more with
    # recompute (pipelines, remat, the chunked loss's backward) and, pipelined, with the
    # report's even split of a `lax.cond` (the loss's `last` branch, which the vocabulary
    # dominates: x3.3 interleaved), never an order of magnitude.
    assert 0.5 < rep.executed_flops / rep.model_flops < 4, rep
    assert 0.0 <= rep.exposed <= 1.0 and rep.total().bytes > 0
    verdict(program, fam)


# ---------------------------------------------------------------------------------------
# Tensor parallelism under fsdp/ZeRO-3 moves only shards (jdist.parallel.grad_sync.on_shards).
@pytest.mark.parametrize("config", [dict(mesh="fsdp=2,tp=4"),
                                    dict(mesh="dp=2,fsdp=2,tp=2", zero=3)],
                         ids=["fsdp2-tp4", "dp2-fsdp2-tp2-zero3"])
def test_tensor_parallel_gathers_and_reduces_only_shards(config):
    """Each weight is gathered over the replica axes into its tensor-sharded block and each
    gradient reduce-scattered from it: the GPU program's parameter all-gathers and gradient
    reduce-scatters are the shard sizes the planner's traffic model derives (within 2%),
    and nothing is all-gathered over `tensor` (before, GSPMD gathered each weight and
    gradient whole over `tensor` first: 2x these bytes on tp=2, 4x on tp=4)."""
    from jdist.plan import traffic

    _, plan, _ = plan_for(TrainConfig.of(**{**COMMON, **config}))
    report = step_report(compile_step(plan, BATCH, SEQ), plan, BATCH, SEQ)
    got = {(r.kind, r.axes): r.bytes for r in report.rows}
    want = {(r.kind, r.axes): r.bytes for r in traffic.step_traffic(plan, BATCH, SEQ)}
    replica = [k for k in want if k[0] in ("all-gather", "reduce-scatter")
               and set(k[1]) <= REPLICA_AXES]
    assert replica
    for key in replica:
        assert got.get(key, 0) == pytest.approx(want[key], rel=0.02), key
    assert not [k for k in got if k[0] == "all-gather" and "tensor" in k[1]], got


# (fsdp2-tp4 is the sequence-parallel family's step: cuDNN, as `auto` resolves on the target.)
@pytest.mark.parametrize("config", [dict(mesh="fsdp=2,tp=4", attention="cudnn"),
                                    dict(mesh="dp=2,fsdp=2,tp=2", zero=3, remat="full")],
                         ids=["fsdp2-tp4", "dp2-fsdp2-tp2-zero3-remat"])
def test_sequence_parallel_activations_travel_beside_matmuls(config):
    """On GPUs sequence parallelism runs its projections as collective matmuls
    (`--collective-matmul auto`, jdist.parallel.collective_matmul): the program moves the
    length chunks the traffic model counts, exactly, and gathers and reduces no layer
    activation over `tensor`. (How much of it the
    schedule hides is measured at scale, by benchmarks/overlap.py: the tiny model's
    transfers outlast their matmuls.)"""
    from jdist.plan import traffic

    program = compile_config({**config, "sequence_parallel": True})
    plan, report = program.plan, program.report
    got = {(r.kind, r.axes): r for r in report.rows}
    want = {(r.kind, r.axes): r.bytes for r in traffic.step_traffic(plan, BATCH, SEQ)}
    moved = ("collective-permute", ("tensor",))
    assert got[moved].bytes == want[moved] > 0
    # What else crosses `tensor` is outside the layers (the loss's and the embedding's
    # gathers, the norm scales' partial sums), no more than the CPU-fitted model of it.
    others = lambda rows: sum(v for (kind, axes), v in rows.items()
                              if axes == ("tensor",) and kind != moved[0])
    assert others({k: r.bytes for k, r in got.items()}) <= others(want), got


# Generation: the prefill and the decode step (jdist.generate) on the target mesh.

GEN_MESH, PROMPT, NEW = "dp=2,tp=4", 16, 8  # a cache of 24 slots: a length nothing else has


def compile_generation(length: int) -> Program:
    cfg = get_preset("tiny", vocab_size=VOCAB)
    mesh = build_mesh(GEN_MESH, list(target.devices(TARGET, 8)))
    plan = inference_plan(cfg, mesh, dtype=jnp.bfloat16)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          plan.abstract.params, plan.shardings.params)
    sh = cache_shardings(mesh, DEFAULT_RULES)
    kv = jax.ShapeDtypeStruct(cache_shapes(cfg, BATCH, PROMPT + NEW)[0], jnp.bfloat16,
                              sharding=sh.keys)
    cache = KVCache(kv, kv, jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.length),
                    jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=sh.start))
    tokens = jax.ShapeDtypeStruct((BATCH, length), jnp.int32, sharding=NamedSharding(
        mesh, resolve((ax.BATCH, ax.LENGTH), DEFAULT_RULES, mesh)))
    step = compiled_step(cfg, mesh, DEFAULT_RULES, jnp.dtype(jnp.bfloat16), GREEDY)
    lowered = step.lower(params, cache, tokens, jax.eval_shape(lambda: jax.random.key(0)),
                         jax.ShapeDtypeStruct((), jnp.int32))
    return read(plan, lowered.compile(target.compiler_options(mesh)))


@pytest.mark.parametrize("length", [PROMPT, 1], ids=["prefill", "decode"])
def test_generation_program(length):
    p = compile_generation(length)
    # Tensor parallel in the compute dtype: the row-parallel outputs are summed in bf16,
    # Megatron's two per layer (attention output, MLP down); besides them only the
    # embedding rows, looked up on the vocabulary shards and summed (float32 table rows,
    # [batch, length, d]: not the table).
    tp_sums = [c for c in p.collectives if c.kind == "all-reduce" and c.axes == ("tensor",)]
    layers = [c for c in tp_sums if c.dtypes == {"bf16"}]
    assert sum(c.times for c in layers) == 2 * p.plan.model.n_layers, tp_sums
    rows = [c for c in tp_sums if c not in layers]
    assert len(rows) == 1 and rows[0].times == 1 and rows[0].arrays[0][1] == \
        (BATCH, length, p.plan.model.d_model), tp_sums
    # The KV cache stays where it is: no collective moves anything cache-long.
    cached = [c for c in p.collectives if any(PROMPT + NEW in s for _, s in c.arrays)]
    assert not cached, cached
    # The step writes the donated cache in place: its keys and values (outputs 1 and 2)
    # alias inputs.
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry", p.text)
    aliased = {int(o) for o in re.findall(r"\{(\d+)\}: \(", alias.group(1))} if alias else set()
    assert {1, 2} <= aliased, aliased
    # Rows are looked up where the table lies: no whole table gathered over tensor.
    assert not check_no_table_gather(p, None), check_no_table_gather(p, None)


# ---------------------------------------------------------------------------------------
# The target itself, the plugin, and the CLI.


def test_cuda_plugin_is_installed():
    """Everything above needs it; CI installs it (`.ci/run`: the cuda12 extra)."""
    assert target.plugin_installed(), "jax's CUDA plugin is missing: " + target.CUDA_EXTRA
    # jax[cuda12] pins the plugin to jax's own version; a mismatch would not load.
    assert importlib.metadata.version("jax-cuda12-plugin") == jax.__version__


def test_scheduling_flags_are_spelled_as_the_installed_jaxlib_spells_them():
    """Each candidate scheduling flag (`jdist.runtime.target.candidate_flags`), and each flag jdist
    sets (`gpu_flags`), is a compile option
    the installed jaxlib's GPU compiler accepts (newer XLA's spellings are refused by older
    ones), and this jaxlib has candidates at all (else nobody measured it)."""
    flags = target.candidate_flags()
    assert flags, f"no scheduling flags listed for jaxlib {jax.__version__}; measure them"
    assert target.gpu_flags(), f"no GPU flags for jaxlib {jax.__version__}; measure them"
    flags |= target.gpu_flags(estimator=True)  # the ones jdist sets, too
    mesh = build_mesh("fsdp=2", list(target.devices(TARGET, 2)))
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P(ax.FSDP)))
    lowered = jax.jit(lambda a: a @ a.T).lower(x)
    for flag, value in flags.items():
        lowered.compile({**target.compiler_options(mesh), flag: value})
    with pytest.raises(Exception, match="No such compile option"):
        lowered.compile({**target.compiler_options(mesh), "xla_gpu_no_such_flag": True})


def test_xla_latency_estimator_is_chosen_per_step():
    """jdist sets XLA's analytical latency estimator where it hid more of the measured steps
    (collective matmuls over two devices, none, dense and without stages) and not where it
    hid less (wider collective matmuls, `--tp-halves`) or crashed the compiler
    (`jdist.step.build.compiler_options`)."""
    from jdist.step.build import compiler_options

    def options(**config) -> dict:
        _, plan, _ = plan_for(TrainConfig.of(**{**COMMON, **config}))
        return compiler_options(plan)

    flag = "xla_gpu_enable_analytical_latency_estimator"
    on = flag in target.gpu_flags(estimator=True)  # the installed jaxlib's GPU compiler runs it
    assert options(mesh="fsdp=4,tp=2", sequence_parallel=True).get(flag, False) == on
    assert options(mesh="fsdp=2,tp=4").get(flag, False) == on  # no SP: no transfers
    assert flag not in options(mesh="fsdp=2,tp=4", sequence_parallel=True)
    assert flag not in options(mesh="fsdp=4,tp=2", sequence_parallel=True, tp_halves=True,
                               batch_size=16)  # 4 rows per device: halves of 2
    assert flag not in options(mesh="dp=2,pp=2,tp=2", pp_schedule="gpipe")
    assert flag not in options(model="moe-tiny", mesh="dp=2,ep=4")
    assert options(mesh="fsdp=4,tp=2", sequence_parallel=True)[
        "xla_gpu_experimental_parallel_collective_overlap_limit"] == 4  # beside jdist's flags


def test_jax_stays_on_the_cpu():
    """Without an NVIDIA driver, the plugin installed changes nothing for the CPU tests:
    importing jdist keeps jax on the 8 simulated CPU devices, GPU targets or not."""
    target.devices(TARGET, 8)
    if not os.path.exists("/proc/driver/nvidia/version"):
        assert jax.default_backend() == "cpu" and jax.device_count() == 8


def test_auto_attention_resolves_as_on_the_target():
    """cuDNN on capability >= 8.0 in bf16 (A100 and H100), never in float32."""
    def resolved(name, dtype):
        _, plan, _ = plan_for(TrainConfig.of(model="tiny", mesh="dp=8", target=name,
                                             compute_dtype=dtype))
        return attention_of(plan, SEQ)

    assert resolved("a100-80gb", "bfloat16") == "cudnn"
    assert resolved(TARGET, "bfloat16") == "cudnn"
    assert resolved(TARGET, "float32") != "cudnn"


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_is_refused_for_a_target(offload):
    """Compile-only devices list no memories, so pinned-host state would silently stay on
    the device: refused in one line instead of measured wrongly."""
    with pytest.raises(ConfigError, match=f"--offload {offload} cannot be compiled"):
        plan_for(TrainConfig.of(**{**COMMON, "mesh": "dp=2,fsdp=4", "offload": offload}))


def test_hosts_split_the_target_devices():
    _, plan, _ = plan_for(TrainConfig.of(model="tiny", mesh="dp=2,fsdp=8", target=TARGET, hosts=2))
    devices = plan.mesh.devices
    assert devices.size == 16 and {d.process_index for d in devices.flat} == {0, 1}
    assert all(target.is_compile_only(d) for d in devices.flat)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jdist.train", *args], check=False,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, says", [
    (["--target", TARGET], "add --dry-run"),
    (["--dry-run", "--target", "b200"], "unknown --target 'b200'"),
])
def test_cli_refuses_what_a_target_cannot_do(args, says):
    result = run_cli("--model", "tiny", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()  # one line: no plugin traceback either
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_cli_dry_run_compiles_for_the_target():
    result = run_cli("--model", "tiny", "--mesh", "dp=2,fsdp=2,tp=2", "--compute-dtype",
                     "bfloat16", "--batch-size", "8", "--seq-len", "128", "--dry-run",
                     "--target", TARGET)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "GPU compiler" in out and f"compiled for 8 x {TARGET}" in out, out
    assert "attention: cudnn (--attention auto)" in out, out
    assert "GPU program: communication per step" in out, out
