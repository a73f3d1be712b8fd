"""Tests run on 8 simulated CPU devices (set before JAX initialises its backends)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest

from jdist import data


@pytest.fixture(scope="session")
def corpus() -> data.Corpus:
    """The builtin corpus (Python stdlib source), loaded once per test session."""
    return data.load_corpus(None, seq_len=128)
