"""Pipeline parallelism: the schedule tables (pure Python, full matrix), every schedule and
stage count trained against one device, the collectives that move activations, and the
one-line errors."""

import collections
import dataclasses
import math
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jdist import data
from jdist.errors import ConfigError
from jdist.models import get_preset
from jdist.parallel.pipeline import PipelineConfig, check_pipeline
from jdist.parallel.pipeline import schedule as sched
from jdist.parallel.pipeline import shuffle as layer_shuffle
from jdist.parallel.pipeline.layer_order import (
    layer_order,
    order_of,
    permute,
    restore_order,
    to_model_order,
)
from jdist.spmd.mesh import build_mesh, parse_mesh
from jdist.spmd.rules import DEFAULT_RULES, with_sequence_parallel
from jdist.step.build import make_eval_step, make_train_step
from jdist.step.state import init_state
from jdist.tools.equivalence import assert_matches, config, plan_of, train_steps
from jdist.tools.hlo import collective_counts, executed_collective_bytes, loop_bodies

LOSS_RTOL = 1e-5
DEEP = get_preset("tiny", n_layers=8)  # 8 layers: pp=4 x 2 virtual stages still divides
BATCH = 32  # divides data x micro-batches on every mesh below
# Embedding and head (split over stage between steps) and final norm (vocab 256, d 64).
SHARED_SHAPES = [(DEEP.vocab_size, DEEP.d_model)] * 2 + [(DEEP.d_model,)]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("factor", [1, 2, 4, 8])
@pytest.mark.parametrize("name, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                           ("interleaved", 3)])
def test_executed_bubble_is_the_formula(name, virtual, stages, factor):
    micro = factor * stages
    table = sched.build(name, stages, micro, virtual)
    assert table.bubble_fraction() == pytest.approx(
        (stages - 1) / (virtual * micro + stages - 1), abs=1e-12)
    ops = [(s, op) for row in table.grid for s, op in enumerate(row) if op is not None]
    assert len(ops) == len(set(ops)) == 2 * micro * virtual * stages  # each op exactly once
    # Activation memory: gpipe stashes every micro-batch, 1f1b about P whatever M is.
    if name == "gpipe":
        assert table.n_slots == micro
    if name == "1f1b":
        assert table.n_slots <= stages


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("name, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_stash_holds_the_residuals_of_micro_batches_in_flight(name, virtual, stages, micro):
    """A stash table (`--remat` other than full) keeps each forward's residuals from its tick
    to its backward's: as many at once as micro-batches in flight (all M under gpipe, at
    most P under 1f1b whatever M is), each read back by the backward of the same micro-batch
    and chunk; chunk inputs are freed by their forward."""
    table = sched.build(name, stages, micro, virtual, stash=True)
    recompute = sched.build(name, stages, micro, virtual)
    assert table.grid == recompute.grid and table.n_slots <= recompute.n_slots
    highs = []
    for s in range(stages):
        held, high = {}, 0
        for t, row in enumerate(table.grid):
            op = row[s]
            if op is None:
                assert table.res_slot[t][s] == -1
                continue
            key = (op.micro, op.chunk)
            if op.kind == sched.FWD:
                assert table.res_slot[t][s] not in held.values()
                held[key] = table.res_slot[t][s]
            else:
                assert held.pop(key) == table.res_slot[t][s]
                assert table.in_slot[t][s] == -1  # the backward reads no chunk input
            high = max(high, len(held))
        assert not held
        highs.append(high)
    assert table.n_res_slots == max(highs)  # slots are reused as soon as they are free
    if name == "gpipe":
        assert table.n_res_slots == micro
    if name == "1f1b":
        assert table.n_res_slots <= stages


def test_schedule_grid_reads_like_the_textbook():
    text = sched.build("1f1b", 2, 4).render()
    assert "bubble 0.200 (formula 0.200)" in text
    assert text.splitlines()[1:] == ["stage  0 | F0 F1  . B0 F2 B1 F3 B2  . B3",
                                     "stage  1 |  . F0 B0 F1 B1 F2 B2 F3 B3  ."]


@pytest.fixture(scope="module")
def reference(single_device):
    return single_device(DEEP, batch_size=BATCH)


_RUNS: dict = {}
SEQUENCE_PARALLEL = {"pp=2,fsdp=2,tp=2"}


def pipelined(corpus, mesh: str, schedule: str, micro: int, zero: int = 0,
              remat: str = "none"):
    key = (mesh, schedule, micro, zero, remat)
    if key not in _RUNS:
        virtual = 2 if schedule in ("interleaved", "zbv") else 1
        # `--prefetch on`: auto prefetches on GPUs only, and stages that gather run it here.
        sp = mesh in SEQUENCE_PARALLEL
        _RUNS[key] = train_steps(DEEP, mesh, corpus.train,
                                 config(batch_size=BATCH, zero=zero, prefetch="on",
                                        remat=remat),
                                 rules=with_sequence_parallel(DEFAULT_RULES) if sp
                                 else DEFAULT_RULES,
                                 pipeline=PipelineConfig(schedule, micro, virtual))
    return _RUNS[key]


# gpipe and interleaved with pp=2, 1f1b and interleaved with pp=4, M = P, plus dp x pp x tp with
# ZeRO-2, and fsdp x tp inside stages (the prefetching layer loop, sequence parallelism). All
# under `--remat none`, where a backward reads its forward's stash; one 1f1b and one interleaved
# table recompute from the chunk input (`--remat full`), and one interleaved and two zero-bubble
# tables stash what the selective policy keeps (their weight halves compute the layer's norms
# and activations again).
# (M = 4P, gpipe on pp=4 - all forwards then all backwards, the simplest table - and M = 2P for
# gpipe and 1f1b on pp=2 added compiles and no new schedule shape: the tables' own tests cover
# every M. So did M = 2P for 1f1b and interleaved on pp=4: their steady state, and stash slots
# reused by later micro-batches, run on pp=2 with M = 2P below (dp x pp x tp, fsdp x tp, ZeRO-2,
# remat) and on pp=4 in zb-h1 and zbv with M = 8. Also dropped, for the suite's time: 1f1b on
# pp=2 alone, which the dp x pp x tp and fsdp x tp cases run with M = 2P, and interleaved on
# pp=2 with M = 2P under `--remat none`, which its `--remat full` and selective ZeRO-2 cases
# run.)
MATRIX = [("pp=2", "gpipe", 2, 0, "none"), ("pp=4", "1f1b", 4, 0, "none"),
          ("pp=2", "interleaved", 2, 0, "none"), ("pp=4", "interleaved", 4, 0, "none")]


@pytest.mark.parametrize("mesh, schedule, micro, zero, remat",
                         [*MATRIX, ("dp=2,pp=2,tp=2", "1f1b", 4, 2, "none"),
                          ("pp=2,fsdp=2,tp=2", "1f1b", 4, 0, "none"),
                          ("pp=4", "1f1b", 4, 0, "full"), ("pp=2", "interleaved", 4, 0, "full"),
                          ("pp=2,fsdp=2", "interleaved", 4, 2, "selective"),
                          # Zero-bubble: backwards split into input and weight gradients.
                          ("pp=4", "zb-h1", 8, 0, "none"),
                          ("pp=2,fsdp=2,tp=2", "zb-h1", 4, 0, "selective"),
                          ("dp=2,pp=2,tp=2", "zb-h1", 4, 2, "everything_saveable"),
                          # ZB-V: two chunks per stage in a V, the last stage's turn local.
                          ("pp=4", "zbv", 8, 0, "selective"),
                          ("pp=2,fsdp=2,tp=2", "zbv", 4, 2, "none")])
def test_pipeline_matches_single_device(corpus, reference, mesh, schedule, micro, zero, remat):
    run = pipelined(corpus, mesh, schedule, micro, zero, remat)
    assert_matches(run, reference)


TIED = get_preset("tiny", n_layers=8, tie_embeddings=True)


@pytest.fixture(scope="module")
def tied_reference(single_device):
    return single_device(TIED, batch_size=BATCH)


@pytest.mark.parametrize("mesh, schedule, micro", [("pp=4,dp=2", "zb-h1", 4),
                                                   ("pp=2,fsdp=2", "1f1b", 4),
                                                   ("pp=2,dp=2", "zbv", 4)])
def test_tied_embeddings_match_single_device(corpus, tied_reference, mesh, schedule, micro):
    """One table read by the first chunk's lookup and the last chunk's head: its gradient
    is the sum of both, over stages (ZeRO-2: reduce-scattered over fsdp in each tick; ZB-V:
    both on the first stage)."""
    run = train_steps(TIED, mesh, corpus.train,
                      config(batch_size=BATCH, zero=2, prefetch="on"),
                      pipeline=PipelineConfig(schedule, micro, 1 + (schedule == "zbv")))
    assert_matches(run, tied_reference)


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_zero_bubble_fills_the_drain_with_weight_gradients(stages, factor):
    """ZB-H1's table: every F, B and W once per micro-batch, a W after its B; at most P-s
    micro-batches between forward and backward on stage s (1F1B's stash) and at most P-1
    weight gradients waiting; idle (P-1) ticks of 3M+P-1. With F, B and W a unit of time
    each, that is a third of 1F1B's idle time, 3(P-1) units (its backward takes two)."""
    micro = factor * stages
    table = sched.build("zb-h1", stages, micro)
    assert table.bubble_fraction() == pytest.approx(table.expected_bubble(), abs=1e-12)
    idle = table.bubble_fraction() * table.ticks  # per stage, in units
    assert idle == pytest.approx(stages - 1)
    one_f_one_b = sched.build("1f1b", stages, micro)
    assert one_f_one_b.bubble_fraction() * 3 * (micro + stages - 1) == pytest.approx(
        3 * (stages - 1))
    for s in range(stages):
        ops = [row[s] for row in table.grid if row[s] is not None]
        assert sorted((op.kind, op.micro) for op in ops) == sorted(
            (k, m) for k in (sched.FWD, sched.BWD, sched.WGT) for m in range(micro))
        seen: dict = {}
        for t, op in enumerate(ops):
            seen[(op.kind, op.micro)] = t
            if op.kind == sched.WGT:
                assert seen[(sched.BWD, op.micro)] < t
            done = collections.Counter(k for k, _ in seen)
            assert done[sched.FWD] - done[sched.BWD] <= stages - s
            assert done[sched.BWD] - done[sched.WGT] <= stages - 1 + (op.kind == sched.BWD)
    assert table.n_res_slots <= stages and table.n_w_slots <= 2 * stages - 1


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_zero_bubble_v_halves_zero_bubble_h1s_idle_time(stages, factor):
    """ZB-V's table: stage s runs chunks s and 2P-1-s (the first stage embeds and takes the
    loss; the last passes its first chunk's output to its own second chunk); every F, B and
    W of both chunks once, a W after its B, a B after the next chunk's B; at most 2P
    half-size chunks' residuals on any stage (1F1B's first stage's memory) and P W pending.
    Idle: P-1 half-chunk ticks per stage, half of ZB-H1's P-1 chunk ticks."""
    micro = factor * stages
    table = sched.build("zbv", stages, micro, 2)
    assert table.bubble_fraction() == pytest.approx(table.expected_bubble(), abs=1e-12)
    assert table.bubble_fraction() * table.ticks == pytest.approx(stages - 1)
    h1 = sched.build("zb-h1", stages, micro)
    assert table.bubble_fraction() * table.ticks / 2 == pytest.approx(
        h1.bubble_fraction() * h1.ticks / 2)  # in units of a whole chunk's F
    place = lambda s, v: sched.chunk_index("zbv", s, v, stages)
    assert sorted(place(s, v) for s in range(stages) for v in (0, 1)) == list(
        range(2 * stages))
    assert place(0, 0) == 0 and place(0, 1) == 2 * stages - 1
    assert place(stages - 1, 1) == place(stages - 1, 0) + 1
    done: dict = {}
    for t, row in enumerate(table.grid):
        for s, op in enumerate(row):
            if op is None:
                continue
            c = place(s, op.chunk)
            assert (op.kind, op.micro, c) not in done
            needs = {sched.FWD: [(sched.FWD, op.micro, c - 1)] if c else [],
                     sched.BWD: [(sched.FWD, op.micro, c)] + (
                         [(sched.BWD, op.micro, c + 1)] if c < 2 * stages - 1 else []),
                     sched.WGT: [(sched.BWD, op.micro, c)]}[op.kind]
            assert all(done[n] < t for n in needs), (t, s, op)
            done[(op.kind, op.micro, c)] = t
    assert len(done) == 3 * 2 * stages * micro
    for s in range(stages):
        kinds = collections.Counter()
        for row in table.grid:
            if row[s] is not None:
                kinds[row[s].kind] += 1
                assert kinds[sched.FWD] - kinds[sched.BWD] <= 2 * stages
                assert kinds[sched.BWD] - kinds[sched.WGT] <= stages
    # Only the last stage hands anything to itself: its first chunk's output, and the
    # cotangent its second chunk pulls back to it.
    for source in (table.recv_fwd, table.recv_bwd):
        turns = {s for row in source[sched.SELF] for s, slot in enumerate(row) if slot >= 0}
        assert turns == {stages - 1}


def _matmul_flops(jaxpr, trips: int = 1) -> int:
    """Matmul FLOPs of a jaxpr, loops by their length (both branches of a cond counted)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            k = math.prod(eqn.invars[0].aval.shape[i] for i in contracted)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * k * trips
        inner = trips * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else trips
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    total += _matmul_flops(sub, inner)
    return total


def test_weight_half_does_a_third_of_the_backward_under_every_stashing_remat(monkeypatch):
    """The split backward of the tiny model's own chunk, under each `--remat` a zero-bubble
    schedule accepts: the weight half runs a third or more of the backward's matmul FLOPs,
    also where the layer recomputes its forward (selective), and no matmul runs twice."""
    from jdist.models.remat import NAMES
    from jdist.parallel import pipeline
    from jdist.parallel.pipeline import split_backward

    flops: dict = {}
    original = split_backward.halves

    def spy(backward, n_res):
        split = original(backward, n_res)
        flops[remat] = (_matmul_flops(split.input_grad.jaxpr),
                        _matmul_flops(split.weight_grad.jaxpr), _matmul_flops(backward))
        return split

    monkeypatch.setattr(split_backward, "halves", spy)
    tokens = jax.ShapeDtypeStruct((8, 32), np.int32)
    remats = [n for n in NAMES if pipeline.stashes(n)]
    assert "selective" in remats
    for remat in remats:
        plan = plan_of("pp=2", n_layers=DEEP.n_layers, batch_size=8, seq_len=32, remat=remat,
                       pp_schedule="zb-h1", microbatches=2)
        make_train_step(plan).lower(plan.abstract, {"inputs": tokens, "targets": tokens})
    for remat, (b, w, whole) in flops.items():
        assert w / (b + w) > 1 / 3, (remat, b, w)
        assert b + w == whole, (remat, b, w, whole)


def test_stash_executes_no_forward_twice(corpus):
    """The compiled step's matmul FLOPs (loops by their trips, the switch's branches by the
    schedule's share of ticks): recomputing each chunk from its input (`--remat full`) runs
    every block forward twice more than reading the forward's stash (`--remat none`) does,
    about 5 / 3 of it; the stash's own are those of the unpipelined step (benchmarks/
    pipeline.py, within 3%)."""
    from jdist.tools import gpu_report

    mesh = build_mesh("pp=4", jax.devices()[:4])
    shares = gpu_report.pipeline_shares(SimpleNamespace(pipeline=PipelineConfig("1f1b", 4),
                                                        mesh=mesh))
    flops = {remat: gpu_report.report(pipelined(corpus, "pp=4", "1f1b", 4, 0, remat).hlo,
                                       mesh, 0.0, shares).executed_flops
             for remat in ("none", "full")}
    assert 1.4 < flops["full"] / flops["none"] < 1.8, flops


# The equivalence cases' runs (what they stash changes no collective).
@pytest.mark.parametrize("mesh, schedule, micro, remat", [("pp=4", "1f1b", 4, "none"),
                                                          ("pp=2", "interleaved", 2, "none"),
                                                          ("pp=4", "zbv", 8, "selective")])
def test_activations_move_with_collective_permutes_only(corpus, mesh, schedule, micro, remat):
    hlo = pipelined(corpus, mesh, schedule, micro, remat=remat).hlo
    counts = collective_counts(hlo)
    # The tick loop: one permute up, one down (ZB-V too: what a tick sends goes one way,
    # and the last stage's turn stays on it), nothing else crosses stages.
    ticks = [b for b in loop_bodies(hlo) if collective_counts(b)["collective-permute"]]
    assert len(ticks) == 1
    assert collective_counts(ticks[0]) == {**dict.fromkeys(counts, 0), "collective-permute": 2}
    assert counts["collective-permute"] == 2
    # Outside it, the embedding and head, stored split over stage, gathered whole before
    # the ticks and their gradients reduce-scattered back after them; the loss and the final
    # norm's gradient summed over stage. Block parameters and their gradients never leave
    # their stage (interleaved and zbv included, whose stacks are stored in chunk order,
    # see jdist.parallel.pipeline.layer_order).
    assert counts["all-to-all"] == 0
    moved = executed_collective_bytes(hlo)
    tables = sum(4 * math.prod(shape) for shape in SHARED_SHAPES[:2])
    stages = int(mesh.split("=")[1])
    assert moved["all-gather"] == tables and moved["reduce-scatter"] == tables // stages
    norm = 4 * math.prod(SHARED_SHAPES[2])
    assert norm <= moved["all-reduce"] <= norm + 1024


MOE = get_preset("moe-tiny", n_layers=4)  # dropless routing
MOE_MICRO = 4


@pytest.fixture(scope="module")
def moe_reference(single_device):
    """MoE balancing losses are per micro-batch, so the single-device reference accumulates
    the same strided micro-batches the pipeline streams."""
    return single_device(MOE, batch_size=16, grad_accum=MOE_MICRO)


# (interleaved pp=2,ep=2: the grouped-experts case below, the same layout and schedule.)
@pytest.mark.parametrize("mesh, schedule", [("dp=2,pp=2,ep=2", "1f1b")])
def test_moe_pipeline_with_expert_parallelism_matches_single_device(corpus, moe_reference,
                                                                     mesh, schedule):
    run = train_steps(MOE, mesh, corpus.train, config(batch_size=16),
                      pipeline=PipelineConfig(schedule, MOE_MICRO, 1 + (schedule == "interleaved")))
    assert_matches(run, moe_reference)
    # Tokens reach their experts inside the stage: dispatch and return, forward and backward.
    assert collective_counts(run.hlo)["all-to-all"] >= 4


def test_pipelined_grouped_experts_and_routing_biases_match_single_device(corpus,
                                                                         single_device):
    """Grouped experts with aux-loss-free balancing on an interleaved pp=2 x ep=2, against
    the padded dropless path on one device: each chunk's loads land at its layers' rows of
    the stored (permuted) stack, so the biases equal one device's exactly."""
    padded = dataclasses.replace(MOE, router_bias_rate=0.01)
    reference = single_device(padded, batch_size=16, grad_accum=MOE_MICRO)
    run = train_steps(dataclasses.replace(padded, moe_routing="grouped"), "pp=2,ep=2",
                      corpus.train, config(batch_size=16),
                      pipeline=PipelineConfig("interleaved", MOE_MICRO, 2))
    assert_matches(run, reference)
    assert collective_counts(run.hlo)["all-to-all"] >= 4  # the experts' exchanges, in stages
    bias = reference.params["blocks"]["mlp"]["router_bias"]
    assert np.abs(bias).max() > 0
    np.testing.assert_array_equal(run.params["blocks"]["mlp"]["router_bias"], bias)


def test_pipelined_moe_reports_load_metrics(corpus):
    """Capacity routing drops tokens: the pipelined step reports what the same expert groups
    report without stages, accumulating the same micro-batches (capacity is per group, so
    one device would drop differently), and a load imbalance."""
    def metrics(mesh, **flags):
        plan = plan_of(mesh, model="moe-tiny", n_layers=4, moe_routing="capacity",
                       capacity_factor=0.5, batch_size=16, seq_len=32, **flags)
        batch = data.global_batch(corpus.train, 0, 0, 16, 32, plan.batch_sharding)
        _, out = make_train_step(plan)(init_state(plan, 0), batch)
        return {k: float(v) for k, v in out.items()}

    plain = metrics("ep=2", grad_accum=MOE_MICRO)
    piped = metrics("pp=2,ep=2", pp_schedule="1f1b", microbatches=MOE_MICRO)
    assert 0.2 < piped["moe_dropped_fraction"] < 0.9
    assert piped["moe_dropped_fraction"] == pytest.approx(plain["moe_dropped_fraction"], rel=1e-5)
    assert piped["moe_load_imbalance"] >= 1.0
    for key in ("ce_loss", "moe_aux_loss", "moe_z_loss", "loss"):
        assert piped[key] == pytest.approx(plain[key], rel=1e-5), key


@pytest.fixture(scope="module")
def long_reference(single_device):
    return single_device(DEEP, batch_size=16, seq_len=64)


@pytest.mark.parametrize("mesh, schedule, strategy", [
    ("pp=2,sp=2", "1f1b", "ring"), ("pp=2,sp=2", "interleaved", "ulysses")])
def test_context_parallel_stages_match_single_device(corpus, long_reference, mesh, schedule,
                                                     strategy):
    run = train_steps(DEEP, mesh, corpus.train,
                      config(batch_size=16, seq_len=64, cp_strategy=strategy),
                      pipeline=PipelineConfig(schedule, 4, 1 + (schedule == "interleaved")))
    assert_matches(run, long_reference)
    # Only the pipeline's two permutes: nested in a stage, the ring shifts by all-gather
    # (a permute inside one stage's branch would meet other stages' permutes, see
    # jdist.parallel.attention.ring.Ring.shift).
    assert collective_counts(run.hlo)["collective-permute"] == 2


@pytest.mark.parametrize("model, mesh, schedule, strategy", [
    (MOE, "pp=2,ep=2,tp=2", "1f1b", "ring"), (DEEP, "pp=2,fsdp=2,tp=2", "interleaved", "ring")])
def test_tensor_parallel_stages_match_single_device(request, corpus, model, mesh, schedule,
                                                    strategy):
    """tp next to another automatic axis inside a stage (MoE and attention kernels nested,
    or plain fsdp): a gather split over both (the loss's label pick, the ring's token
    reorder) aborted XLA's SPMD partitioner; the stage program now avoids both."""
    moe = bool(model.n_experts)
    built = build_mesh(mesh, jax.devices()[: parse_mesh(mesh).n_devices()])
    pipeline = PipelineConfig(schedule, 4, 1 + (schedule == "interleaved"))
    check_pipeline(pipeline, model, built, 16)  # accepted
    reference = request.getfixturevalue("moe_reference" if moe else "long_reference")
    flags = config(steps=len(reference.losses), batch_size=16, seq_len=32 if moe else 64,
                   cp_strategy=strategy)
    run = train_steps(model, mesh, corpus.train, flags, pipeline=pipeline)
    assert_matches(run, reference)


def evaluate(corpus, mesh: str, **pipeline):
    """(eval loss of the initial parameters, collective counts of the compiled eval step);
    `pipeline`: the pipeline's flags (`pp_schedule`, `microbatches`, ...)."""
    plan = plan_of(mesh, n_layers=DEEP.n_layers, batch_size=BATCH, seq_len=32, **pipeline)
    params = init_state(plan, 0).params
    batch = data.global_batch(corpus.val, 0, 0, BATCH, 32, plan.batch_sharding,
                              data.VAL_STREAM)
    step = make_eval_step(plan).lower(params, batch).compile()
    return float(step(params, batch)), collective_counts(step.as_text())


@pytest.mark.parametrize("mesh, schedule, micro", [("pp=2", "interleaved", 4),
                                                   ("dp=2,pp=2,tp=2", "1f1b", 2),
                                                   ("pp=2", "zbv", 2)])
def test_evaluation_runs_forward_through_the_stages(corpus, mesh, schedule, micro):
    """Evaluation is a forward-only pass of the schedule: the same loss as one device, and
    no stage ever gathers another stage's blocks."""
    want, _ = evaluate(corpus, "dp=1")
    got, counts = evaluate(corpus, mesh, pp_schedule=schedule, microbatches=micro,
                           pp_virtual_stages=1 + (schedule == "interleaved"))
    assert abs(got - want) <= LOSS_RTOL * want
    # Forward activations only: up the stages, and in the V back down.
    assert counts["collective-permute"] == 1 + (schedule == "zbv")
    if "tp" not in mesh:
        assert counts["all-gather"] == 2  # the embedding and head, stored split over stage


def test_forward_only_schedule_keeps_one_input_per_stage():
    table = sched.build("1f1b", 4, 16, forward_only=True)
    assert table.n_slots == 1 and table.ticks == 16 + 3
    assert all(op is None or op.kind == sched.FWD for row in table.grid for op in row)


def test_layer_shuffle_moves_by_permutes_only():
    """Reordering a stage-sharded stack never gathers it: L/P rounds of permutes."""
    rng = np.random.default_rng(0)
    for stages, n_layers in [(2, 8), (4, 16), (8, 8)]:
        change = rng.permutation(n_layers)
        moves = layer_shuffle.rounds(change, stages)
        assert len(moves) == n_layers // stages
        landed = {}
        for perm, send, receive in moves:
            assert sorted(b for _, b in perm) == list(range(stages))  # one layer per stage
            for a, b in perm:
                landed[b * (n_layers // stages) + receive[b]] = a * (n_layers // stages) + send[a]
        assert [landed[i] for i in range(n_layers)] == change.tolist()
    change = rng.permutation(16)
    mesh = build_mesh("pp=4,fsdp=2")
    x = jax.device_put(np.arange(16 * 6 * 4, dtype=np.float32).reshape(16, 6, 4),
                       NamedSharding(mesh, PartitionSpec("stage", "fsdp")))
    move = jax.jit(lambda x: layer_shuffle.shuffle(x, change, mesh), out_shardings=x.sharding)
    assert np.array_equal(np.asarray(move(x)), np.asarray(x)[change])
    counts = collective_counts(move.lower(x).compile().as_text())
    assert counts == {**dict.fromkeys(counts, 0), "collective-permute": 4}


def test_interleaved_state_with_offloaded_optimizer_changes_order():
    """Initialising and re-ordering a state whose optimizer moments live in host memory
    (a plain checkpoint resumed onto an interleaved mesh)."""
    deep = {"n_layers": DEEP.n_layers, "batch_size": 16, "seq_len": 32, "microbatches": 4}
    plan = plan_of("pp=2,fsdp=2", **deep, offload="optimizer", pp_schedule="interleaved",
                   pp_virtual_stages=2)
    state = init_state(plan, 0)
    plain = init_state(plan_of("pp=2,fsdp=2", **deep), 0)
    w = lambda s: np.asarray(s.params["blocks"]["mlp"]["w_up"])
    assert np.array_equal(w(state), w(plain)[order_of(plan)])
    before = w(state)
    again = restore_order(plan, state, order_of(plan)[::-1].tolist())  # as if saved reversed
    assert np.array_equal(w(again), before[np.argsort(order_of(plan)[::-1])][order_of(plan)])
    mu = jax.tree.leaves(again.opt_state)[1]
    assert mu.sharding.memory_kind == "pinned_host"


def test_interleaved_storage_order_round_trips():
    order = layer_order(8, 2, 2)  # 2 layers per chunk; stage 0 runs chunks 0, 2
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    stack = {"blocks": {"w": np.arange(8.0)[:, None]}, "embed": np.arange(8.0)}
    plan = SimpleNamespace(model=DEEP, mesh=SimpleNamespace(shape={"stage": 2}),
                           pipeline=PipelineConfig("interleaved", 4, 2))
    stored = permute(stack, order_of(plan))
    assert stored["blocks"]["w"][:, 0].tolist() == order.tolist()
    assert stored["embed"].tolist() == stack["embed"].tolist()  # not a layer stack
    assert to_model_order(plan, stored)["blocks"]["w"][:, 0].tolist() == list(range(8))


@pytest.mark.parametrize("args, message", [
    (("1f1b", 4, 2, 1, 8), "needs at least pp=4 micro-batches"),
    (("gpipe", 4, 4, 1, 6), "6 layers do not split into pp=4 equal chunks"),
    (("interleaved", 2, 4, 2, 6), "6 layers do not split into pp=2 x 2 virtual stages"),
    (("interleaved", 2, 3, 2, 8), "change --microbatches 3 to a multiple of 2"),
    (("zigzag", 2, 2, 1, 8), "unknown pipeline schedule 'zigzag'"),
    (("zb-h1", 4, 2, 1, 8), "zb-h1 needs at least pp=4 micro-batches"),
    (("zb-h1", 2, 4, 2, 8), "--pp-virtual-stages 2 needs --pp-schedule interleaved"),
    (("zbv", 2, 4, 3, 12), "zbv runs 2 chunks per stage"),
    (("zbv", 4, 3, 2, 8), "zbv needs at least pp=4 micro-batches"),
    (("zbv", 4, 4, 2, 4), "4 layers do not split into pp=4 x 2 virtual stages = 8"),
])
def test_bad_configurations_name_the_fix(args, message):
    with pytest.raises(ConfigError, match=message):
        sched.check(*args)


def test_cli_zero_bubble_without_a_stash_is_one_line_and_exit_2(train_refusal):
    assert train_refusal(["--model", "tiny", "--mesh", "pp=2", "--pp-schedule", "zb-h1",
                          "--remat", "full", "--pp-show-schedule"]) == (
        "jdist: error: --pp-schedule zb-h1 defers weight gradients, which read the forward's "
        "residuals, but --remat full keeps none on the device; use --remat selective or "
        "none, or --pp-schedule 1f1b")


def test_cli_bad_schedule_is_one_line_and_exit_2(train_refusal):
    assert train_refusal(["--model", "tiny", "--mesh", "pp=2", "--n-layers", "6",
                          "--pp-schedule", "interleaved", "--pp-virtual-stages", "2",
                          "--microbatches", "4", "--pp-show-schedule"]) == (
        "jdist: error: 6 layers do not split into pp=2 x 2 virtual stages = 4 equal chunks; "
        "change --n-layers to a multiple of 4")
