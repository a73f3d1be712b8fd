"""Every parallel layout trains exactly like one device (float32, same seed and batches)."""

import jax
import jax.numpy as jnp
import pytest

from jdist.equivalence import loss_rel_diff, param_abs_diff, train_steps
from jdist.rules import DEFAULT_RULES, with_sequence_parallel
from models import get_preset

LOSS_RTOL = 1e-5   # per-step losses, relative
PARAM_ATOL = 2e-6  # final parameters (init std 0.02), absolute; observed ~2e-7

TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def reference(corpus):
    return train_steps(TINY, "dp=1", corpus.train)


@pytest.mark.parametrize("mesh, sequence_parallel", [
    ("dp=8", False),
    ("fsdp=8", False),
    ("dp=2,tp=4", False),
    ("dp=2,fsdp=2,tp=2", False),
    ("fsdp=2,tp=4", True),
    ("dp=2,fsdp=4", False),
])
def test_matches_single_device(corpus, reference, mesh, sequence_parallel):
    rules = with_sequence_parallel(DEFAULT_RULES) if sequence_parallel else DEFAULT_RULES
    run = train_steps(TINY, mesh, corpus.train, rules)
    assert loss_rel_diff(run, reference) <= LOSS_RTOL, (run.losses, reference.losses)
    assert param_abs_diff(run, reference) <= PARAM_ATOL
    assert run.losses[-1] < run.losses[0] - 0.5  # and it actually learned something


def test_bfloat16_compute_tracks_float32(corpus, reference):
    run = train_steps(TINY, "dp=2,fsdp=2,tp=2", corpus.train, compute_dtype=jnp.bfloat16)
    assert loss_rel_diff(run, reference) < 2e-2
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(run.params))


def test_tied_embeddings_match_single_device(corpus):
    tied = get_preset("tiny", tie_embeddings=True)
    reference = train_steps(tied, "dp=1", corpus.train, steps=5)
    run = train_steps(tied, "fsdp=2,tp=4", corpus.train, steps=5)
    assert loss_rel_diff(run, reference) <= LOSS_RTOL
    assert param_abs_diff(run, reference) <= PARAM_ATOL
    assert "head" not in run.params
