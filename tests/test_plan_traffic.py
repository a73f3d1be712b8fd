"""jdist.plan.traffic: a step's collectives predicted from the plan alone, against what
jdist.tools.comm.report reads from the compiled step (8 simulated devices, the tiny model, one
compile per layout)."""

import glob
import math
import re
import tempfile

import jax
import jax.numpy as jnp
import pytest

from jdist.config import TrainConfig
from jdist.memory import compile_step
from jdist.plan import traffic
from jdist.step.build import make_train_step
from jdist.step.from_flags import plan_for
from jdist.tools import comm, gpu_report, hlo

TOLERANCE = 0.05  # relative, per collective kind and in total


def plan_of(mesh: str, batch: int = 8, seq: int = 32, model: str = "tiny", **flags):
    return plan_for(TrainConfig.of(model=model, mesh=mesh, batch_size=batch, seq_len=seq,
                                   **flags))[1]


def measured(plan, batch: int, seq: int, text: str | None = None) -> list[comm.Row]:
    """The compiled step's report, less its rows over groups of one device (axes ()),
    which move nothing and which the prediction leaves out."""
    text = text or compile_step(plan, batch, seq).as_text()
    return [r for r in comm.report(text, plan.mesh).rows if r.axes]


def by_kind(rows) -> dict[str, int]:
    out = dict.fromkeys(hlo.COLLECTIVES, 0)
    for r in rows:
        out[r.kind] += r.bytes
    return out


def assert_matches(predicted, actual):
    """Bytes per kind and in total within TOLERANCE, over the same (kind, axes) rows."""
    assert {(r.kind, r.axes) for r in predicted} == {(r.kind, r.axes) for r in actual}
    want, got = by_kind(actual), by_kind(predicted)
    for kind in hlo.COLLECTIVES:
        assert got[kind] == pytest.approx(want[kind], rel=TOLERANCE), kind
    assert sum(got.values()) == pytest.approx(sum(want.values()), rel=TOLERANCE)


LAYOUTS = {  # id: (mesh, flags)
    "dp=8 zero0": ("dp=8", {}),
    "dp=2,fsdp=4 zero2 accum2": ("dp=2,fsdp=4", {"zero": 2, "grad_accum": 2, "batch": 16}),
    "dp=8 zero3": ("dp=8", {"zero": 3}),  # the plain layer loop (auto on the CPU)
    "dp=8 zero3 prefetch": ("dp=8", {"zero": 3, "prefetch": "on"}),
    "fsdp=2,tp=4 sp": ("fsdp=2,tp=4", {"sequence_parallel": True}),
    "dp=2,sp=4 ring": ("dp=2,sp=4", {"cp_strategy": "ring"}),
    "dp=2,sp=4 ulysses": ("dp=2,sp=4", {"cp_strategy": "ulysses"}),
    "pp=2,dp=4 1f1b": ("pp=2,dp=4", {"batch": 16}),
    "moe fsdp=2,ep=2,tp=2": ("fsdp=2,ep=2,tp=2", {"model": "moe-tiny"}),
    "moe grouped dp=2,fsdp=2,tp=2": ("dp=2,fsdp=2,tp=2",
                                     {"model": "moe-tiny", "moe_routing": "grouped"}),
    # Two runs (models.runs), each two (sliding, full) periods: dense blocks' Megatron
    # reductions, then the experts' dispatch, per block of a period.
    "dense then moe, periods fsdp=2,ep=2,tp=2": ("fsdp=2,ep=2,tp=2", {
        "model": "dense-moe-tiny", "n_layers": 8, "first_dense_layers": 4,
        "sliding_window": 8, "full_attention_every": 2}),
}

@pytest.mark.parametrize("mesh,flags", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_step_traffic_matches_the_compiled_report(mesh, flags):
    flags = dict(flags)
    batch = flags.pop("batch", 8)
    plan = plan_of(mesh, batch, **flags)
    assert_matches(traffic.step_traffic(plan, batch, 32), measured(plan, batch, 32))


def test_grouped_expert_rounds_move_one_round_near_balance():
    """Grouped MoE with ep: the model prices the first round of jdist.parallel.expert_rounds;
    the loop of later rounds (data-dependent trip count) runs no time near balance."""
    plan = plan_of("fsdp=2,ep=2,tp=2", model="moe-tiny", moe_routing="grouped")
    text = compile_step(plan, 8, 32).as_text()
    first_round = [r for r in gpu_report.report(text, plan.mesh, unknown_trips=0).rows if r.axes]
    assert_matches(traffic.step_traffic(plan, 8, 32), first_round)


def test_pipeline_branches_count_once_per_micro_batch_and_chunk():
    """Inside a stage's `lax.switch` branch the report counts each collective once (it
    cannot know how often a branch runs): `reported_traffic` matches it; `step_traffic`
    counts what runs, M x V chunk forwards and backwards (here the fsdp gathers and
    reduce-scatters of each layer, the embedding's all-to-alls, the head's chunks)."""
    plan = plan_of("pp=2,fsdp=4", 16, pp_schedule="interleaved", pp_virtual_stages=2,
                   n_layers=4)
    assert_matches(traffic.reported_traffic(plan, 16, 32), measured(plan, 16, 32))
    executed = {(r.kind, r.axes): r.bytes for r in traffic.step_traffic(plan, 16, 32)}
    reported = {(r.kind, r.axes): r.bytes for r in traffic.reported_traffic(plan, 16, 32)}
    assert executed.keys() == reported.keys()
    # Per-tick permutes and the end-of-step sums are outside the branches: the same.
    for key in [("collective-permute", ("stage",)), ("all-reduce", ("stage",))]:
        assert executed[key] == reported[key]
    # Every gather runs in a branch: M x V = 4 chunk runs (M = 2 for the embedding/loss).
    gathers = executed[("all-gather", ("fsdp",))] / reported[("all-gather", ("fsdp",))]
    assert 2 < gathers <= 4


@pytest.mark.slow  # one compile, 8 s
def test_heterogeneous_pipeline_counts_each_runs_branch():
    """Dense blocks then experts on pp=2 (jdist.step.pipelined: each run a chunk of every
    stage, the chunk a `lax.switch` over the runs): the report counts each run's branch
    once, and the embedding and loss, traced in every branch, once per run."""
    plan = plan_of("pp=2,fsdp=4", 16, model="dense-moe-tiny", pp_schedule="interleaved",
                   pp_virtual_stages=2)
    assert_matches(traffic.reported_traffic(plan, 16, 32), measured(plan, 16, 32))


def _compile_with_partitioned(plan, batch: int, seq: int) -> tuple[str, str]:
    """(compiled HLO text, HLO right after SPMD partitioning) from one compile."""
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    lowered = make_train_step(plan).lower(plan.abstract, {"inputs": tokens, "targets": tokens})
    with tempfile.TemporaryDirectory() as where:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": where, "xla_dump_hlo_as_text": True,
            "xla_dump_hlo_pass_re": "spmd-partitioning"})
        (path,) = glob.glob(f"{where}/*after_spmd-partitioning*.txt")
        with open(path) as f:
            return compiled.as_text(), f.read()


def _distinct(text: str, mesh) -> set[tuple]:
    """(kind, axes, dtype, elements) of every collective of HLO text over > 1 device."""
    out = set()
    for kind, result, rest, _ in hlo.executed_collectives(text):
        axes = comm.axes_of(hlo.device_groups(rest, mesh.devices.size), mesh)
        arrays = re.findall(r"\b([a-z]+\d+)\[([\d,]*)\]", result)
        elements = sum(math.prod(int(d) for d in filter(None, dims.split(",")))
                       for _, dims in arrays)
        if axes:
            out |= {(kind, axes, dtype, elements) for dtype, _ in arrays}
    return out


def test_bfloat16_moves_what_the_program_says():
    """bf16 compute, remat full, dp x fsdp x tp. The CPU backend upcasts bf16 collectives
    to f32 after partitioning, so its report reads the float32 plan's bytes; the program's
    dtypes (HLO right after partitioning) are the ones the prediction gives each
    collective: parameters gathered and activations moved in bf16, gradients in f32."""
    plan = plan_of("dp=2,fsdp=2,tp=2", compute_dtype="bfloat16", remat="full")
    compiled, partitioned = _compile_with_partitioned(plan, 8, 32)
    as_on_cpu = plan.computing(dtype=jnp.float32)
    assert_matches(traffic.step_traffic(as_on_cpu, 8, 32), measured(plan, 8, 32, compiled))
    predicted = {(c.kind, c.axes, c.dtype, c.elements)
                 for c in traffic.collectives(plan, 8, 32) if c.count and c.axes}
    assert predicted == _distinct(partitioned, plan.mesh)
    bf16 = sum(r.bytes for r in traffic.step_traffic(plan, 8, 32))
    assert bf16 < 0.75 * sum(r.bytes for r in traffic.step_traffic(as_on_cpu, 8, 32))


def test_data_parallel_reduces_every_parameter_once_in_float32():
    """No compile: DDP all-reduces each gradient, float32, once per step (with gradient
    accumulation too); a tied table twice, the lookup's and the loss's parts of its
    gradient each (as the compiled tiny step does). A 70B-shaped plan costs milliseconds."""
    for model, accum in [("llama3.2-1b", 1), ("llama3.1-70b", 4)]:
        plan = plan_of("dp=8", 32, 1024, model, grad_accum=accum, compute_dtype="bfloat16")
        rows = traffic.step_traffic(plan, 32, 1024)
        assert {(r.kind, r.axes) for r in rows} == {("all-reduce", ("data",))}
        cfg = plan.model
        table = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
        scalars = 4 + 4  # the token count and the loss
        assert rows[0].bytes == 4 * (cfg.n_params() + table) + scalars


def test_zero3_over_data_runs_fsdp_collectives_over_another_axis():
    """`dp=8 --zero 3` lays the state out like `fsdp=8` (README): the same parameter
    gathers and gradient reduce-scatters, over data, plus the norm scales ZeRO-3 also
    splits (fsdp leaves them whole)."""
    zero3 = traffic.step_traffic(plan_of("dp=8", 32, 1024, "llama3.2-1b", zero=3), 32, 1024)
    fsdp = traffic.step_traffic(plan_of("fsdp=8", 32, 1024, "llama3.2-1b"), 32, 1024)
    z, f = by_kind(zero3), by_kind(fsdp)
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert z[kind] == pytest.approx(f[kind], rel=1e-3)
    assert {r.axes for r in zero3} == {("data",)} and {r.axes for r in fsdp} == {("fsdp",)}


def test_group_size_and_rows():
    plan = plan_of("dp=2,fsdp=2,tp=2")
    assert traffic.group_size(plan, ("data", "tensor")) == 4
    assert traffic.group_size(plan, ()) == 1
    rows = traffic.step_traffic(plan, 8, 32)
    order = {kind: i for i, kind in enumerate(hlo.COLLECTIVES)}
    assert rows == sorted(rows, key=lambda r: (order[r.kind], r.axes))
    names = plan.mesh.axis_names
    assert all(list(r.axes) == sorted(r.axes, key=names.index) for r in rows)
    assert all(r.seconds == 0 and r.count > 0 and r.bytes > 0 for r in rows)
