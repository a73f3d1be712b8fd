"""The chunked, vocabulary-parallel loss equals the loss from full logits."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jdist.models.loss import cross_entropy
from jdist.parallel.vocab import chunk_size, vocab_parallel_cross_entropy
from jdist.spmd.mesh import build_mesh
from jdist.tools.hlo import collective_bytes

RTOL = 1e-6
B, S, E, V = 2, 16, 8, 96


def problem(vocab=V):
    keys = jax.random.split(jax.random.key(2), 4)
    h = jax.random.normal(keys[0], (B, S, E))
    w = jax.random.normal(keys[1], (E, vocab))
    labels = jax.random.randint(keys[2], (B, S), 0, vocab)
    return h, w, labels, jax.random.normal(keys[3], (B, S))


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("mesh, w_spec, tied, vocab", [
    ("dp=1", P(), False, V),
    ("tp=4", P(None, "tensor"), False, V),  # the head sharded over vocab
    ("tp=4", P("tensor", None), True, V),   # a tied table [vocab, embed]
    ("dp=2,tp=2", P(None, "tensor"), False, V),  # tokens split over data too (dW summed)
    ("tp=2", P(None, "tensor"), False, 94),  # 47 rows a shard: chunks of 8, the last overlapping
])
def test_chunked_loss_equals_full_logits(mesh, w_spec, tied, vocab):
    h, w, labels, g = problem(vocab)
    n = {"dp=1": 1, "tp=4": 4, "dp=2,tp=2": 4, "tp=2": 2}[mesh]
    devices = build_mesh(mesh, jax.devices()[:n])
    table = w.T if tied else w
    tokens = P("data") if "dp=2" in mesh else P()
    budget = 4 * B * S * 8  # chunks of 8 vocabulary rows: several per shard

    def chunked(h, table):
        ce = vocab_parallel_cross_entropy(h, table, labels, vocab_dim=0 if tied else 1,
                                          mesh=devices, h_spec=tokens, w_spec=w_spec,
                                          label_spec=tokens, chunk_bytes=budget)
        return jnp.sum(ce * g)

    def full(h, table):
        logits = jnp.einsum("bse,ve->bsv" if tied else "bse,ev->bsv", h, table)
        return jnp.sum(cross_entropy(logits, labels) * g)

    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.value_and_grad(chunked, (0, 1)))(h, table)
        want = jax.value_and_grad(full, (0, 1))(h, table)
    assert abs(float(got[0] - want[0])) <= RTOL * abs(float(want[0]))
    assert rel(got[1][0], want[1][0]) <= RTOL and rel(got[1][1], want[1][1]) <= RTOL


def test_vocab_sharded_loss_never_gathers_the_vocabulary():
    # Only per-token statistics cross devices: max, sum-exp and the label's logit forward,
    # the hidden-state gradient backward. Nothing [tokens, vocab]- or weight-sized.
    h, w, labels, _ = problem()
    mesh = build_mesh("tp=4", jax.devices()[:4])
    loss = lambda h, w: vocab_parallel_cross_entropy(
        h, w, labels, vocab_dim=1, mesh=mesh, h_spec=P(), w_spec=P(None, "tensor"),
        label_spec=P()).sum()
    text = jax.jit(jax.grad(loss, (0, 1))).lower(h, w).compile().as_text()
    moved = collective_bytes(text)
    assert moved.get("all-gather", 0) == 0
    assert 0 < moved["all-reduce"] <= 4 * (3 * B * S + B * S * E)


def test_chunks_divide_the_vocabulary_and_fit_the_budget():
    assert chunk_size(8192, 128_256) == 1002   # 8192 x 1002 float32 = 31.3 MiB <= 32 MiB
    assert chunk_size(8192, 32_064) == 1002
    assert chunk_size(1, 256) == 256
    assert chunk_size(8192, 50_257) == 1024  # 29 x 1733: 50 chunks, the last overlapping
