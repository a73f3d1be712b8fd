"""Sliding-window attention and learned sinks: the dense reference against a masked softmax
written out here, every kernel against the dense reference, and the work a window skips."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jdist.config import TrainConfig
from jdist.generate import forward, init_cache, left_pad
from jdist.models import get_preset
from jdist.models.context import LOCAL as LOCAL_CONTEXT
from jdist.models.layers import dot_product_attention
from jdist.parallel import attention as attn
from jdist.parallel.attention import blockwise as bw
from jdist.parallel.attention import cudnn_attention
from jdist.parallel.attention.context import ALL_GATHER, RING, ULYSSES, ContextParallel
from jdist.parallel.attention.flash import flash_attention
from jdist.parallel.attention.load_balance import ring_work
from jdist.runtime import target
from jdist.spmd.mesh import build_mesh, parse_mesh
from jdist.spmd.rules import DEFAULT_RULES
from jdist.step.from_flags import plan_for
from jdist.step.state import build_model
from jdist.tools import gpu_report
from jdist.tools.equivalence import assert_matches, config, train_steps

RTOL = 1e-5  # max |error| / max |reference|
WINDOW = 11  # under context parallelism: a window of a few chunks, not a multiple of one


def inputs(b=2, s=48, h=8, kv=2, d=16):
    keys = jax.random.split(jax.random.key(3), 5)
    shapes = ((b, s, h, d), (b, s, kv, d), (b, s, kv, d), (b, s, h, d))
    q, k, v, cotangent = (jax.random.normal(key, shape) for key, shape in zip(keys, shapes))
    sinks = 2.0 * jax.random.normal(keys[4], (h,))  # large enough to take much of each row
    return q, k, v, sinks, cotangent


def masked_softmax_attention(q, k, v, window, sinks):
    """What sliding-window attention with sinks means, per row, in float64 numpy: query i
    sees keys i - window + 1 .. i; the sink of its head joins the denominator only."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for row in range(b):
        for head in range(h):
            for i in range(s):
                keys = range(max(0, i - window + 1) if window else 0, i + 1)
                logits = [q[row, i, head] @ k[row, j, head // group] / np.sqrt(d) for j in keys]
                sink = -np.inf if sinks is None else float(sinks[head])
                top = max(max(logits), sink)
                weights = np.exp(np.array(logits) - top)
                denominator = weights.sum() + np.exp(sink - top)
                out[row, i, head] = sum(w * v[row, j, head // group]
                                        for w, j in zip(weights, keys)) / denominator
    return out


def rel_err(x, ref) -> float:
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize("window, with_sinks", [(5, True), (5, False), (None, True)])
def test_dense_reference_is_the_masked_softmax(window, with_sinks):
    q, k, v, sinks, _ = inputs(b=1, s=12, h=4, kv=2, d=8)
    sinks = sinks if with_sinks else None
    with jax.default_matmul_precision("highest"):
        got = dot_product_attention(q, k, v, True, window=window, sinks=sinks)
    assert rel_err(got, masked_softmax_attention(q, k, v, window, sinks)) <= RTOL


def out_and_grads(attention, q, k, v, sinks, cotangent):
    def f(q, k, v, sinks):
        out = attention(q, k, v, sinks)
        return jnp.sum(out * cotangent), out
    grad = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)
    (_, out), grads = jax.jit(grad)(q, k, v, sinks)
    return [out, *grads]


def assert_matches_dense(attention, window, s=48, segment_ids=None, **shape):
    q, k, v, sinks, cotangent = inputs(s=s, **shape)
    with jax.default_matmul_precision("highest"):
        ref = out_and_grads(lambda q, k, v, sinks: dot_product_attention(
            q, k, v, True, segment_ids, window=window, sinks=sinks), q, k, v, sinks, cotangent)
        got = out_and_grads(attention, q, k, v, sinks, cotangent)
    errors = [rel_err(a, b) for a, b in zip(got, ref)]
    assert max(errors) <= RTOL, errors


@pytest.mark.parametrize("window, tiles", [
    (5, (8, 16)), (1, (12, 4)),  # a window across tiles, and one of a single key
])
def test_flash_with_window_and_sinks_matches_dense(window, tiles):
    assert_matches_dense(lambda q, k, v, sinks: flash_attention(
        q, k, v, True, q_tile=tiles[0], k_tile=tiles[1], window=window, sinks=sinks), window)


def test_flash_with_a_window_at_a_traced_offset_attends_like_the_tail():
    # What all-gather context parallelism runs at long lengths: local queries at a traced
    # position, a fixed count of key tiles (12 tiles of 4; 3 per query tile), unaligned.
    q, k, v, sinks, cotangent = inputs()
    tail = lambda q, k, v, sinks: jax.jit(partial(flash_attention, q_tile=4, k_tile=4,
                                                  window=5, sinks=sinks))(
        q[:, 30:], k, v, query_offset=jnp.int32(30))
    with jax.default_matmul_precision("highest"):
        got = out_and_grads(tail, q, k, v, sinks, cotangent[:, 30:])
        ref = out_and_grads(lambda q, k, v, sinks: dot_product_attention(
            q, k, v, True, window=5, sinks=sinks)[:, 30:], q, k, v, sinks, cotangent[:, 30:])
    errors = [rel_err(a, b) for a, b in zip(got, ref)]
    assert max(errors) <= RTOL, errors


def test_flash_with_a_window_skips_the_tiles_outside_it(monkeypatch):
    # 64 keys in tiles of 4, window 8: each query tile runs a fixed 3 key tiles (its own
    # and the two holding the 7 keys before its first query), each key tile 3 query tiles
    # in the backward: 16 x 3 blocks each way, where causal alone computes 136.
    q, k, v, sinks, _ = inputs(b=1, s=64, h=1, kv=1, d=8)
    calls = []
    mask = bw.block_mask

    def counted(*args):  # a host callback per executed block
        jax.debug.callback(lambda: calls.append(1))
        return mask(*args)

    monkeypatch.setattr(bw, "block_mask", counted)
    counts = []
    for window in (8, None):
        calls.clear()
        loss = lambda q, k, v, w=window: flash_attention(q, k, v, q_tile=4, k_tile=4, window=w,
                                                         sinks=sinks[:1]).sum()
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        jax.effects_barrier()
        counts.append(len(calls))
    assert counts == [2 * 48, 2 * 136]


def mesh_of(text: str):
    spec = parse_mesh(text)
    return build_mesh(spec, jax.devices()[: spec.n_devices()])


@pytest.mark.parametrize("mesh, strategy", [
    ("sp=8", RING),            # balanced chunks of 4: pairs beyond the window skipped
    ("sp=4,tp=2", RING),       # the sinks split over tensor with the heads
    ("sp=2,tp=2,dp=2", ALL_GATHER),
    ("sp=2,tp=2,dp=2", ULYSSES),
])
def test_context_parallel_with_window_and_sinks_matches_dense(mesh, strategy):
    cp = ContextParallel(mesh_of(mesh), DEFAULT_RULES, strategy)

    def attention(q, k, v, sinks):  # tokens go into the layout's order and come back out
        moved = (cp.reorder(x) for x in (q, k, v))
        return cp.restore(cp.attention(*moved, True, window=WINDOW, sinks=sinks))

    assert_matches_dense(attention, WINDOW, s=64, kv=4)


def test_ring_skips_the_chunk_pairs_beyond_the_window():
    # 64 tokens in 8 balanced chunks of 8 over 4 devices, window 8: a query chunk meets
    # itself and the chunk before it only; device 0 holds chunks 0 (no chunk before) and 7.
    assert ring_work(4, balanced=True, window=8, seq_len=64) == [3, 4, 4, 4]
    assert ring_work(4, balanced=True) == [9, 9, 9, 9]


LOCAL = dataclasses.replace(get_preset("tiny"), sliding_window=WINDOW, attention_sinks=True)


@pytest.fixture(scope="module")
def reference(single_device):
    return single_device(LOCAL)


# The dense (xla) path partitioned on fsdp=2,tp=2 went for the suite's time: the reference is
# that path on one device, and fsdp=4,tp=2 partitions the sinks and the windowed blocks.
@pytest.mark.parametrize("mesh, flags", [
    ("fsdp=4,tp=2", {"attention": "flash"}),
    ("sp=2", {"cp_strategy": RING}),              # chunks of 8: pairs beyond 11 skipped
    ("sp=2", {"cp_strategy": ALL_GATHER}),
    ("sp=2", {"cp_strategy": ULYSSES}),
], ids=["flash", "ring", "all_gather", "ulysses"])
def test_training_with_window_and_sinks_matches_single_device(corpus, reference, mesh, flags):
    run = train_steps(LOCAL, mesh_of(mesh), corpus.train, config(**flags))
    assert_matches(run, reference)


def test_cached_prefill_and_decode_equal_the_full_forward():
    # Two prompts of 3 and 14 tokens (left-padded to 16), then 8 tokens decoded one at a
    # time, against the whole forward of each row alone: a window of 5 cuts both the prompt
    # and the decoded tokens, the sinks take a large share of every row. Weights 20x the
    # initial scale and sinks of N(0, 2^2), so a wrong mask or sink moves the logits.
    cfg = dataclasses.replace(get_preset("tiny"), sliding_window=5, attention_sinks=True)
    model = build_model(cfg, 0)
    state = nnx.state(model)
    grown = jax.tree.map(lambda x: x * 20 if x.ndim > 2 else x, state)
    nnx.update(model, grown)
    sinks = model.blocks.attn.sinks
    sinks.set_value(2.0 * jax.random.normal(jax.random.key(7), sinks.get_value().shape))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 14)]
    follow = rng.integers(0, 256, (2, 8)).astype(np.int32)  # fed back, one per step
    tokens, start = left_pad(prompts)
    cache = init_cache(cfg, start, tokens.shape[1] + follow.shape[1], jnp.float32,
                       mesh_of("dp=1"))
    step = jax.jit(lambda tokens, cache: forward(model, tokens, cache, LOCAL_CONTEXT))
    with jax.default_matmul_precision("highest"):
        prefill, cache = step(tokens, cache)
        decoded = []
        for i in range(follow.shape[1]):
            logits, cache = step(follow[:, i:i + 1], cache)
            decoded.append(logits[:, 0])
        for row, prompt in enumerate(prompts):
            text = np.concatenate([prompt, follow[row]])[None]
            full = jax.jit(model)(text)[0]
            cached = jnp.concatenate([prefill[row, tokens.shape[1] - len(prompt):],
                                      jnp.stack(decoded, 1)[row]])
            assert rel_err(cached, full[:len(text[0])]) <= RTOL


def test_cudnn_call_takes_the_window_as_jax_defines_it():
    # The arguments cuDNN gets, run through jax's own XLA implementation of the same call.
    q, k, v, _, _ = inputs(s=32)
    with jax.default_matmul_precision("highest"):
        got = cudnn_attention(q, k, v, True, window=6, implementation="xla")
        ref = dot_product_attention(q, k, v, True, window=6)
    assert rel_err(got, ref) <= RTOL


def h100_attention(kernel, seq: int, window: int) -> str:
    """The GPU program (H100, compile-only) of one attention's forward and backward."""
    sharding = SingleDeviceSharding(target.devices("h100-80gb", 1)[0])
    q = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.bfloat16, sharding=sharding)
    loss = lambda q, k, v: kernel(q, k, v, True, window=window).astype(jnp.float32).sum()
    grad = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv)
    return grad.compile(dict(target.COMPILER_OPTIONS)).as_text()


@pytest.mark.gpu_compiler
def test_windowed_flash_flops_grow_with_the_window_not_the_square_of_the_length():
    # Tiles of 128: a window of 128 runs 2 key tiles per query tile (and 2 query tiles per
    # key tile backward), one of 384 runs 4; twice the tokens, twice the tiles.
    mesh = build_mesh("dp=1", list(target.devices("h100-80gb", 1)))
    flash = partial(flash_attention, q_tile=128, k_tile=128)
    flops = {(seq, w): gpu_report.report(h100_attention(flash, seq, w), mesh).executed_flops
             for seq, w in ((2048, 128), (2048, 384), (4096, 128))}
    assert flops[2048, 384] == 2 * flops[2048, 128] > 0
    assert flops[4096, 128] == 2 * flops[2048, 128]


@pytest.mark.gpu_compiler
def test_cudnn_fused_attention_gets_the_window():
    text = h100_attention(cudnn_attention, 1024, 128)
    # Forward and backward fused calls, each told the window (its own left size + 1).
    assert text.count('"sliding_window_length": 128') == 2 and "__cudnn$fmha" in text


def test_sinks_run_flash_where_cudnn_would_run():
    pick = lambda requested, sinks: attn.choose(
        requested, backend="cuda", capability=(9, 0), dtype=jnp.bfloat16, head_dim=64,
        seq_len=4096, context_parallel=False, sinks=sinks)
    assert [pick("auto", False), pick("cudnn", False)] == ["cudnn", "cudnn"]
    assert [pick("auto", True), pick("cudnn", True)] == ["flash", "flash"]


@pytest.mark.gpu_compiler
def test_cudnn_requested_with_sinks_says_flash_runs_in_one_line(capsys):
    config = TrainConfig.of(model="tiny", attention_sinks=True, attention="cudnn",
                            compute_dtype="bfloat16", target="h100-80gb", mesh="dp=1")
    _, plan, _ = plan_for(config)
    assert plan.compute.attention == "flash"
    assert capsys.readouterr().err.splitlines() == [f"jdist: {attn.SINKS_ON_CUDNN}"]


def test_flash_with_window_sinks_and_packed_documents_matches_dense():
    segments = jnp.repeat(jnp.array([[0, 1, 2], [0, 0, 1]]), 16, axis=1)  # [2, 48]
    assert_matches_dense(lambda q, k, v, sinks: flash_attention(
        q, k, v, True, q_tile=8, k_tile=8, window=11, sinks=sinks, segment_ids=segments),
        11, segment_ids=segments)


def test_hugging_face_export_refuses_a_window_or_sinks_in_one_line():
    from jdist.errors import ConfigError
    from jdist.hf.config import hf_config

    for cfg in (dataclasses.replace(LOCAL, attention_sinks=False),
                dataclasses.replace(LOCAL, sliding_window=None)):
        with pytest.raises(ConfigError, match="^export to Hugging Face of sliding-window"):
            hf_config(cfg)
