"""Context parallelism over `sequence`: each attention strategy against dense attention,
whole training runs against one device, and the collectives each strategy compiles to."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.models import get_preset
from jdist.models.layers import dot_product_attention
from jdist.parallel.attention.context import ALL_GATHER, RING, ULYSSES, ContextParallel
from jdist.parallel.attention.load_balance import balanced_order, ring_work
from jdist.parallel.attention.ring import Ring, ring_attention
from jdist.spmd.mesh import build_mesh, parse_mesh
from jdist.spmd.rules import DEFAULT_RULES
from jdist.tools.equivalence import assert_matches, config, train_steps
from jdist.tools.hlo import collective_counts, executed_collective_bytes, loop_bodies

ATTN_RTOL = 1e-5   # max |error| / max |reference|, outputs and gradients; observed <= ~6e-7
TINY = get_preset("tiny")  # 8 heads, 4 kv heads: every test below is grouped-query attention


def mesh_of(text: str):
    spec = parse_mesh(text)
    return build_mesh(spec, jax.devices()[: spec.n_devices()])


def rel_err(x, ref) -> float:
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


def qkv_and_cotangent(b=2, s=64, h=8, kv=4, d=16):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d))
    k = jax.random.normal(keys[1], (b, s, kv, d))
    v = jax.random.normal(keys[2], (b, s, kv, d))
    return (q, k, v), jax.random.normal(keys[3], (b, s, h, d))


def value_and_grads(attention, qkv, cotangent):
    """Output and d(sum(out * cotangent))/d(q, k, v), compiled."""
    def f(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(out * cotangent), out
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*qkv)
    return out, grads


def assert_matches_dense(attention, causal: bool) -> None:
    qkv, cotangent = qkv_and_cotangent()
    ref_out, ref_grads = value_and_grads(
        lambda q, k, v: dot_product_attention(q, k, v, causal), qkv, cotangent)
    out, grads = value_and_grads(attention, qkv, cotangent)
    errors = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errors) <= ATTN_RTOL, errors


@pytest.mark.parametrize("mesh, strategy, causal", [
    ("sp=8", RING, True),
    ("sp=8", RING, False),
    ("sp=4,tp=2", RING, True),
    ("sp=8", ALL_GATHER, True),
    ("sp=2,tp=2,dp=2", ALL_GATHER, False),
    ("sp=8", ULYSSES, True),        # 4 kv heads < 8 devices: kv heads are repeated
    ("sp=2,tp=2,dp=2", ULYSSES, False),
])
def test_attention_matches_dense(mesh, strategy, causal):
    cp = ContextParallel(mesh_of(mesh), DEFAULT_RULES, strategy)

    def attention(q, k, v):  # tokens go into the layout's order and come back out of it
        return cp.restore(cp.attention(cp.reorder(q), cp.reorder(k), cp.reorder(v), causal))

    assert_matches_dense(attention, causal)


@pytest.mark.parametrize("balanced, tile", [(False, 4), (True, 2)])
def test_ring_with_key_tiles_matches_dense(balanced, tile):
    # Chunks of 8 (contiguous) or 4 (balanced) positions taken in tiles of 4 or 2 keys: the
    # path long sequences take. The contiguous layout is the benchmark's unbalanced baseline.
    cp = ContextParallel(mesh_of("sp=8"), DEFAULT_RULES, RING)
    ring = Ring(cp.axes, cp.size, causal=True, balanced=balanced, tile=tile)

    def attention(q, k, v):
        moved = [cp.reorder(x) if balanced else x for x in (q, k, v)]
        out = ring_attention(*moved, mesh=cp.mesh, q_spec=cp.q_spec, kv_spec=cp.kv_spec,
                             ring=ring)
        return cp.restore(out) if balanced else out

    assert_matches_dense(attention, causal=True)


def test_ring_moves_each_kv_block_once_per_step_and_gradients_home():
    # Forward: K and V shift N-1 times. Backward: K, V and their gradients shift N-1 times,
    # then the gradients once more to their owners. Nothing else communicates.
    cp = ContextParallel(mesh_of("sp=8"), DEFAULT_RULES, RING)
    qkv, cotangent = qkv_and_cotangent()
    fwd_bwd = jax.jit(lambda q, k, v, dout: jax.vjp(cp.attention, q, k, v)[1](dout))
    hlo = fwd_bwd.lower(*qkv, cotangent).compile().as_text()
    n, (b, s, kv, d) = 8, qkv[1].shape
    block = b * (s // n) * kv * d * 4  # one device's K (or V) block, float32
    moved = executed_collective_bytes(hlo)
    assert moved["collective-permute"] == (2 * (n - 1) + 4 * (n - 1) + 2) * block
    assert sum(moved.values()) == moved["collective-permute"]


def test_balanced_order_pairs_early_and_late_chunks():
    order = balanced_order(16, 4)  # 8 chunks of 2; device j holds chunks j and 7 - j
    assert sorted(order) == list(range(16))
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                            [6, 7, 8, 9]]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_balancing_evens_out_causal_work(n):
    contiguous, balanced = ring_work(n, balanced=False), ring_work(n, balanced=True)
    assert max(contiguous) / min(contiguous) == n  # the last device does n times the first's
    # Balanced: 3 tiles at step 0 (two diagonal, one full), 2 at each later step, against
    # 4 per step without a mask: skipping fully masked blocks halves the work.
    assert balanced == [2 * n + 1] * n
    assert ring_work(n, balanced=True, causal=False) == [4 * n] * n


@pytest.fixture(scope="module")
def reference(single_device):
    return single_device(TINY)


@pytest.mark.parametrize("mesh, strategy", [
    # Ring: sp=4 is its kernel above (sp=4,tp=2), no new training path; sp=2 runs inside
    # dp=2,sp=2,tp=2 below (and tests/test_window_sinks.py's and test_pipeline's stages).
    ("sp=8", RING),
    ("sp=2", ALL_GATHER), ("sp=8", ALL_GATHER),  # sp=4: no case sp=2 and sp=8 do not cover
    ("sp=2", ULYSSES), ("sp=8", ULYSSES),
    ("dp=2,sp=2,tp=2", RING),
])
def test_training_matches_single_device(corpus, reference, mesh, strategy):
    run = train_steps(TINY, mesh_of(mesh), corpus.train, config(cp_strategy=strategy))
    assert_matches(run, reference)
    if mesh == "sp=8":  # the HLO test rides on this run's compiled step (compiles are slow)
        assert_layer_collectives(run.hlo, strategy)


LAYER_COLLECTIVES = {  # strategy: (what its layers must run, what they must not)
    RING: ("collective-permute", ("all-gather", "all-to-all")),
    ALL_GATHER: ("all-gather", ("collective-permute", "all-to-all")),
    ULYSSES: ("all-to-all", ("collective-permute", "all-gather")),
}


def assert_layer_collectives(hlo: str, strategy: str) -> None:
    """With only `sequence` sharded, attention is the one thing in a layer that communicates,
    so the layer loops (forward and backward) show exactly the strategy's collective."""
    present, absent = LAYER_COLLECTIVES[strategy]
    counts = [collective_counts(body) for body in loop_bodies(hlo)]
    assert any(c[present] >= 1 for c in counts), counts
    assert all(c[op] == 0 for c in counts for op in absent), counts


def test_positions_follow_the_reordered_tokens():
    cp = ContextParallel(mesh_of("sp=4"), DEFAULT_RULES, RING)
    tokens = jnp.arange(2 * 16).reshape(2, 16)
    moved = np.asarray(cp.reorder(tokens))
    assert (moved[0] == cp.positions(16)).all() and (moved[1] == cp.positions(16) + 16).all()
    assert (np.asarray(cp.restore(cp.reorder(tokens))) == np.asarray(tokens)).all()
