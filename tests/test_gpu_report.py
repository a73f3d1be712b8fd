"""The GPU program report (jdist.tools.gpu_report) on programs compiled by XLA's GPU compiler for a
deviceless H100 target: FLOPs of known matmuls, collective bytes as jdist.tools.comm counts them,
loop weighting, and the exposure metric with a negative control."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jdist.config import TrainConfig
from jdist.memory import compile_step
from jdist.runtime import target
from jdist.spmd.mesh import build_mesh
from jdist.step.from_flags import plan_for
from jdist.tools import comm, gpu_report

pytestmark = pytest.mark.gpu_compiler

H100 = "h100-80gb"


def gpu_mesh(text: str, n: int = 8):
    return build_mesh(text, list(target.devices(H100, n, 1)))


@pytest.fixture(scope="module")
def fsdp_step():
    """A tiny fsdp=8 step (2 layers, bf16, cuDNN) compiled for 8 H100s."""
    config = TrainConfig.of(model="tiny", mesh="fsdp=8", batch_size=8, seq_len=128,
                            compute_dtype="bfloat16", attention="cudnn", target=H100)
    _, plan, _ = plan_for(config)
    compiled = compile_step(plan, config.data.batch_size, config.data.seq_len)
    return plan, compiled.as_text()


def test_a_matmul_is_counted_at_its_flops():
    mesh = gpu_mesh("dp=1", 1)
    sharding = NamedSharding(mesh, PartitionSpec())
    a = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=sharding)
    b = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16, sharding=sharding)
    text = jax.jit(jnp.matmul).lower(a, b).compile(target.COMPILER_OPTIONS).as_text()
    assert gpu_report.report(text, mesh).executed_flops == 2 * 256 * 512 * 384


def test_causal_cudnn_attention_counts_half_its_score_matmuls():
    mesh = gpu_mesh("dp=1", 1)
    sharding = NamedSharding(mesh, PartitionSpec())
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16, sharding=sharding)  # b s h d
    attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
    text = attend.lower(q, q, q).compile(target.COMPILER_OPTIONS).as_text()
    assert "__cudnn$fmha" in text
    # QK^T and PV: 2 x (2 * b * h * s * t * d), half of the score matrix under the mask.
    assert gpu_report.report(text, mesh).executed_flops == 0.5 * 2 * 2 * 2 * 4 * 256 * 256 * 64


@pytest.mark.parametrize("mode", ["rowwise", "off"])
def test_fp8_projection_runs_three_fp8_gemms(mode):
    """`--fp8`'s projection (jdist.quant.fp8) and its gradient on the H100 compiler: forward,
    input gradient and weight gradient are each a gemm on float8 operands, counted at their
    FLOPs; the bf16 projection's three gemms are not FP8 (control)."""
    from jdist.models.projection import project
    from jdist.quant import fp8

    mesh = gpu_mesh("dp=1", 1)
    sharding = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=sharding)
    fn = (lambda x, w: project("bse,ef->bsf", x, w)) if mode == "off" else \
        (lambda x, w: fp8.project("bse,ef->bsf", mode, (), x, w))
    loss = lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) ** 2)
    text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile(
        target.COMPILER_OPTIONS).as_text()
    rep = gpu_report.report(text, mesh)
    assert rep.gemms == 3 and rep.executed_flops == 3 * 2 * 256 * 256 * 512
    assert rep.fp8_gemms == (0 if mode == "off" else 3)
    assert rep.fp8_flops == (0 if mode == "off" else rep.executed_flops)


# (dense-moe-tiny, a heterogeneous stack, was exact too on 2026-12-05; cut for suite time)
@pytest.mark.parametrize("model", ["tiny", "moe-tiny"])
def test_fp8_flops_of_the_cost_model_are_the_compiled_steps(model):
    """The planner prices `--fp8` steps by the FP8 FLOPs of `plan.cost.fp8_flops`: the
    GPU-compiled step (fsdp=8, rowwise, `--remat full`) runs exactly those on float8
    operands. Dense: the projections' three passes and the recomputed forward less the down
    projection, whose output no backward reads (`selective` matched too when measured).
    MoE (padded dropless experts, E/k times the routed rows): the experts' forward and
    input gradient, and the whole forward again; dense blocks then experts (two runs), each
    run's."""
    remat = "full"
    from jdist.parallel.moe import expert_factor
    from jdist.plan.cost import fp8_flops

    config = TrainConfig.of(model=model, mesh="fsdp=8", batch_size=8, seq_len=128,
                            compute_dtype="bfloat16", fp8="rowwise", remat=remat,
                            target=H100)
    _, plan, _ = plan_for(config)
    rep = gpu_report.step_report(compile_step(plan, 8, 128), plan, 8, 128)
    tokens = 8 * 128 / 8
    experts = expert_factor(plan.model, tokens, 1)
    assert rep.fp8_flops == fp8_flops(plan.model, tokens, remat, False, 1, experts)


def test_collective_bytes_agree_with_the_communication_report(fsdp_step):
    plan, text = fsdp_step
    rep = gpu_report.report(text, plan.mesh)
    base = comm.report(text, plan.mesh)
    assert {(r.kind, r.axes): r.bytes for r in rep.rows} == \
        {(r.kind, r.axes): r.bytes for r in base.rows}
    # Async pairs count their result once: an all-gather's bytes are the gathered
    # parameters, not the start's (operands, results) tuple.
    gathers = sum(r.bytes for r in rep.rows if r.kind == "all-gather")
    layers = plan.model.n_layers
    per_layer = sum(x.size * 2 for x in jax.tree.leaves(plan.abstract.params["blocks"])) / layers
    assert gathers >= layers * per_layer  # every layer gathered (forward, backward)
    assert gathers <= 3 * layers * per_layer + 4 * 2**20


def test_a_step_without_matmuls_in_its_windows_is_fully_exposed(fsdp_step):
    """Negative control: the same program with every matmul renamed away leaves no
    collective hidden, so the metric does look at what is scheduled in the windows."""
    plan, text = fsdp_step
    rep = gpu_report.report(text, plan.mesh)
    assert 0.0 < rep.exposed < 1.0
    hidden = [r for r in rep.rows if r.exposed < 1.0]
    # (The embedding's all-to-all may find a matmul beside it too, since the prefetching
    # layer loop: jdist.parallel.prefetch.)
    assert hidden and all(r.kind in ("all-gather", "reduce-scatter", "all-reduce",
                                     "all-to-all") for r in hidden)
    stripped = re.sub(r'custom_call_target="__(cublas|cudnn)\$', 'custom_call_target="__none$',
                      text)
    stripped = re.sub(r"= (\S+) (dot|convolution)\(", r"= \1 negate(", stripped)
    assert gpu_report.report(stripped, plan.mesh).exposed == 1.0


def test_loop_collectives_are_weighted_by_trip_count(fsdp_step):
    plan, text = fsdp_step
    weighted = gpu_report.executions(text)
    loops = re.findall(r'body=%?([\w.\-]+).*?"known_trip_count":\{"n":"(\d+)"', text)
    assert loops and all(weighted[body] >= int(n) for body, n in loops)


def test_peak_breakdown_accounts_for_the_state_and_the_layer_loop():
    """XLA's account of the peak (`--peak-breakdown`), here of the CPU compiler: the
    parameters as the arguments hold them, the rest attributed to the step's operations;
    its total (`live_peak`) holds the state and lies within what the heap lays out."""
    from jdist.memory import compile_step, peak
    from jdist.memory.breakdown import live_peak
    from jdist.spmd.sharding import per_device_bytes

    config = TrainConfig.of(model="tiny", mesh="fsdp=8", batch_size=8, seq_len=64, remat="full")
    _, plan, _ = plan_for(config)
    lines: list[str] = []
    compiled = compile_step(plan, config.data.batch_size, config.data.seq_len, lines)
    assert lines and "peak usage" in lines[0]
    state = [line for line in lines if line.endswith("── state")]
    assert len(state) == 1
    held = per_device_bytes(plan.abstract.params, plan.shardings.params)  # `state.params`
    value, unit = state[0].split()[1:3]
    assert float(value) * {"MiB": 2**20, "GiB": 2**30}[unit] == pytest.approx(held, rel=1e-3)
    assert any("jit(step)/shard_map" in line for line in lines)
    assert held < live_peak(lines) <= peak(compiled)
