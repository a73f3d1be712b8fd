"""Every parallel layout computes what one device computes (float32, same seed and batches):
per-step loss and gradient norm, and the first step's gradients leaf by leaf."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jdist.models import get_preset
from jdist.parallel import grad_sync
from jdist.spmd.mesh import build_mesh, parse_mesh
from jdist.spmd.rules import DEFAULT_RULES, with_sequence_parallel
from jdist.tools import comm
from jdist.tools.equivalence import (
    HARNESS,
    assert_matches,
    config,
    loss_rel_diff,
    mismatches,
    train_steps,
)

TINY = get_preset("tiny")


# dp=8 and dp=2,fsdp=2,tp=2 run in tests/test_loss_masks.py, on batches with masked
# targets (uneven counts per replica and micro-batch): the same comparison, a harder batch.
@pytest.mark.parametrize("mesh, sequence_parallel", [
    ("fsdp=8", False),
    ("dp=2,tp=4", False),
    ("fsdp=2,tp=4", True),
    ("dp=2,fsdp=4", False),
])
def test_matches_single_device(corpus, single_device, mesh, sequence_parallel):
    rules = with_sequence_parallel(DEFAULT_RULES) if sequence_parallel else DEFAULT_RULES
    assert_matches(train_steps(TINY, mesh, corpus.train, rules=rules), single_device(TINY))


@pytest.mark.parametrize("prefetch", ["on", "off"])
def test_zero3_tensor_parallel_with_and_without_prefetch(corpus, single_device, prefetch):
    """Four layers, so the prefetching loop (jdist.parallel.prefetch) runs its backward
    loop, under ZeRO-3 x tp with selective remat (its residuals kept, its gathered weights
    dropped and gathered again); and the plain loop (`--prefetch off`, auto's choice on the
    CPU) on the same layout."""
    deep = dataclasses.replace(TINY, n_layers=4)
    run = train_steps(deep, "dp=2,fsdp=2,tp=2", corpus.train,
                      config(zero=3, remat="selective", prefetch=prefetch))
    assert_matches(run, single_device(deep))


def test_layers_on_two_halves_of_the_rows_match_single_device(corpus, single_device):
    """`--tp-halves` (jdist.parallel.halves) under sequence parallelism and the prefetching
    loop, as GPUs run it: 4 rows per device, each layer run on two halves of 2."""
    deep = dataclasses.replace(TINY, n_layers=4)
    run = train_steps(deep, "fsdp=2,tp=4", corpus.train,
                      config(tp_halves=True, prefetch="on", remat="full",
                             collective_matmul="on"),
                      rules=with_sequence_parallel(DEFAULT_RULES))
    assert_matches(run, single_device(deep))


@pytest.mark.parametrize("mesh, flags", [
    ("fsdp=2,tp=4", {}),
    ("dp=2,fsdp=2,tp=2", {"zero": 3, "prefetch": "on", "remat": "full"}),
])
def test_collective_matmuls_match_single_device(corpus, single_device, mesh, flags):
    """`--collective-matmul on` (jdist.parallel.collective_matmul), as GPUs run sequence
    parallelism: the length chunks travel over `tensor`, each straight from its owner,
    beside the projections' matmuls. The program moves exactly those chunks: per layer and
    forward, two widening and two narrowing projections of n-1 transfers each, as many
    again transposed in the backward, and the widening inputs' chunks again for the weight
    gradients (the step keeps only shards); under remat full the forward again, but for its
    last projection, which feeds only the layer's output (the backward needs none)."""
    run = train_steps(TINY, mesh, corpus.train, config(collective_matmul="on", **flags),
                      rules=with_sequence_parallel(DEFAULT_RULES))
    assert_matches(run, single_device(TINY))
    shape = parse_mesh(mesh)
    tp, rows = shape.sizes["tensor"], HARNESS["batch_size"] // shape.sizes.get("data", 1) \
        // shape.sizes["fsdp"]
    chunk = rows * HARNESS["seq_len"] // tp * TINY.d_model * 4
    per_layer = 4 + 4 + (3 if flags.get("remat") == "full" else 2)
    expected = TINY.n_layers * per_layer * (tp - 1)
    moved = [r for r in comm.report(run.hlo, build_mesh(mesh, jax.devices()[:8])).rows
             if r.kind == "collective-permute"]
    assert [(r.axes, r.count, r.bytes) for r in moved] == [(("tensor",), expected,
                                                            expected * chunk)]


def test_trains_like_single_device_for_ten_steps(corpus, single_device):
    """Ten steps of a model with Qwen3's RMSNorm of each query and key head (`qk_norm`:
    heads split over tensor, the scales' gradients summed over the replicas) and one table
    for the embedding and the head (its gradient summed over both uses, split over fsdp and
    tensor). Each feature once had its own 3-step case; one run carries both."""
    model = get_preset("tiny", qk_norm=True, tie_embeddings=True)
    run = train_steps(model, "dp=2,fsdp=2,tp=2", corpus.train, config(steps=10))
    assert_matches(run, single_device(model, steps=10))
    assert run.losses[-1] < run.losses[0] - 0.5  # and it actually learned something
    assert {"q_norm", "k_norm"} <= set(run.params["blocks"]["attn"])
    assert "head" not in run.params


def test_a_summed_data_reduction_is_caught(corpus, single_device, monkeypatch):
    """Sum the replicas' gradients instead of averaging them: losses and parameters barely
    move (AdamW and clipping normalise the scale away) but the harness fails."""
    def summing(ct, sync, defer):
        return mean(ct, sync, defer) * sync.replicas
    mean = grad_sync.reduce
    monkeypatch.setattr(grad_sync, "reduce", summing)
    run = train_steps(TINY, "dp=8", corpus.train)
    reference = single_device(TINY)
    assert loss_rel_diff(run, reference) < 1e-3  # what a loss-only harness would accept
    problems = mismatches(run, reference)
    assert any(p.startswith("grad_norm") for p in problems), problems
    assert any(p.startswith("gradient") for p in problems), problems
    with pytest.raises(AssertionError):
        assert_matches(run, reference)


def test_bfloat16_compute_tracks_float32(corpus, single_device):
    run = train_steps(TINY, "dp=2,fsdp=2,tp=2", corpus.train,
                      config(compute_dtype="bfloat16"))
    assert loss_rel_diff(run, single_device(TINY)) < 2e-2
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(run.params))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(run.grads))
