"""ZeRO stages, gradient accumulation, remat and optimizer offload change memory and
communication, never the numbers: each is trained against the single-device run."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jdist.models import get_preset
from jdist.step import make_train_step
from jdist.tools.equivalence import assert_matches, config, plan_of, train_steps
from jdist.tools.hlo import collective_counts, collective_dtypes, loop_bodies, partitioned

TINY = get_preset("tiny")
BATCH = 32  # divisible by data x micro-batches on every mesh below


@pytest.fixture(scope="module")
def reference(single_device):
    return single_device(TINY, batch_size=BATCH)


# Every ZeRO stage on each mesh, and with and without micro-batches, in 8 runs: each pair
# of (mesh, stage), (stage, micro-batches) and (mesh, micro-batches) occurs (all 16
# combinations cost two more minutes of suite time and found nothing the pairs did not).
# Remat and optimizer offload change nothing but memory: three of the dp x fsdp x tp runs
# carry them (each had a run of its own under ZeRO-1: 11 s of suite time).
MEMORY = [{"remat": "full"}, {"offload": "optimizer"}, {"remat": "selective"}, {}]
PAIRWISE = [("dp=8", z, 1 if z % 2 == 0 else 4, {}) for z in range(4)] + \
           [("dp=2,fsdp=2,tp=2", z, 4 if z % 2 == 0 else 1, MEMORY[z]) for z in range(4)]


@pytest.mark.parametrize("mesh, zero, grad_accum, memory", PAIRWISE,
                         ids=[f"{m}-{z}-{a}" for m, z, a, _ in PAIRWISE])
def test_zero_stage_matches_single_device(corpus, reference, mesh, zero, grad_accum, memory):
    run = train_steps(TINY, mesh, corpus.train,
                      config(batch_size=BATCH, zero=zero, grad_accum=grad_accum, **memory))
    assert_matches(run, reference)


TOKENS = jax.ShapeDtypeStruct((BATCH, 32), jnp.int32)
N_BLOCK_LEAVES = 9  # wq wk wv wo, w_gate w_up w_down, two norm scales
# Four layers: the prefetching loop's backward runs n-1 of them in a loop, and XLA unrolls
# a loop of one iteration (jdist.parallel.prefetch).
LOOPED = dataclasses.replace(TINY, n_layers=4)


def lowered_step(mesh: str, zero: int, grad_accum: int = 1, compute_dtype: str = "float32"):
    plan = plan_of(mesh, n_layers=LOOPED.n_layers, batch_size=BATCH, zero=zero,
                   grad_accum=grad_accum, compute_dtype=compute_dtype,
                   prefetch="on")  # what GPUs run: auto is off on the CPU
    return plan, make_train_step(plan).lower(plan.abstract, {"inputs": TOKENS, "targets": TOKENS})


def compiled_step(mesh: str, zero: int, grad_accum: int = 1):
    plan, lowered = lowered_step(mesh, zero, grad_accum)
    return plan, lowered.compile()


def backward_loop(hlo: str) -> dict:
    """Collective counts of the layer loop that reduces gradients (the backward's)."""
    bodies = [collective_counts(b) for b in loop_bodies(hlo)]
    return max(bodies, key=lambda c: c["reduce-scatter"] + c["all-reduce"])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_collectives_per_stage(zero):
    plan, compiled = compiled_step("dp=8", zero)
    text = compiled.as_text()
    counts = collective_counts(text)
    n_params = len(jax.tree.leaves(plan.abstract.params))
    if zero >= 2:  # every gradient reduce-scattered, each layer's inside the backward loop
        # ... but under ZeRO-3 the embedding table's: its lookup gathers token ids and
        # scatter-adds every replica's rows into the local block (jdist.parallel.embedding).
        # ZeRO-3 gathers parameters, so its layers run the prefetching loop
        # (jdist.parallel.prefetch), which reduces the first two layers' after its loop.
        after_loop = 2 * N_BLOCK_LEAVES if zero == 3 else 0
        assert counts["reduce-scatter"] == n_params - (zero == 3) + after_loop
        assert (counts["all-to-all"] >= 2) == (zero == 3)
        assert backward_loop(text)["reduce-scatter"] == N_BLOCK_LEAVES
    else:  # all-reduced inside the backward loop, as each layer's gradient is produced
        assert counts["reduce-scatter"] == 0
        assert backward_loop(text)["all-reduce"] >= 1
    if zero == 3:  # parameters gathered just in time, inside the layer loop
        assert any(collective_counts(b)["all-gather"] >= 1 for b in loop_bodies(text))
    if zero == 0:
        assert counts["all-gather"] == 0


@pytest.mark.parametrize("zero", [1, 2])
def test_accumulation_reduces_once_per_step_or_into_the_sharded_accumulator(zero):
    """With micro-batches, ZeRO-0/1 accumulates locally and all-reduces once after the
    loop; ZeRO-2 reduce-scatters each micro-batch's layer gradients inside it."""
    _, compiled = compiled_step("dp=8", zero, grad_accum=4)
    text = compiled.as_text()
    in_loops = [collective_counts(b) for b in loop_bodies(text)]
    if zero == 1:
        assert all(c["all-reduce"] == 0 and c["reduce-scatter"] == 0 for c in in_loops)
        assert collective_counts(text)["all-reduce"] >= 1
    else:
        assert max(c["reduce-scatter"] for c in in_loops) == N_BLOCK_LEAVES


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_gradient_reductions_run_in_float32_under_bfloat16(zero):
    """Read right after SPMD partitioning (later CPU passes upcast bf16 collectives): every
    reduction is float32, while weights are gathered in bf16 (ZeRO-3, fsdp)."""
    _, lowered = lowered_step("dp=2,fsdp=4", zero, compute_dtype="bfloat16")
    dtypes = collective_dtypes(partitioned(lowered))
    # And one int32 all-reduce: the global count of counted targets (jdist.models.loss).
    assert dtypes["all-reduce"] == {"f32", "s32"}
    assert dtypes["reduce-scatter"] == {"f32"}
    assert "bf16" in dtypes["all-gather"]


def test_zero_shards_state_over_data():
    plan, _ = lowered_step("dp=8", 3)
    assert plan.shardings.params["blocks"]["mlp"]["w_up"].spec == P(None, "data", None)
    plan1, _ = lowered_step("dp=8", 1)
    assert all(p is None for p in plan1.shardings.params["blocks"]["mlp"]["w_up"].spec)
    mu = plan1.shardings.opt_state[1][0].mu["blocks"]["mlp"]["w_up"]
    assert mu.spec == P(None, "data", None)
    plan_h, _ = lowered_step("dp=2,fsdp=2,tp=2", 2)
    assert plan_h.grad_shardings["embed"].spec == P("tensor", ("fsdp", "data"))


def test_zero2_accumulator_is_sharded():
    # The scan carry of accumulated gradients shrinks with the data axis under ZeRO-2.
    _, z0 = compiled_step("dp=8", 0, grad_accum=4)
    _, z2 = compiled_step("dp=8", 2, grad_accum=4)
    assert z2.memory_analysis().temp_size_in_bytes < z0.memory_analysis().temp_size_in_bytes
