"""Attention implementations against the dense reference, and which one a run gets."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from jdist.errors import ConfigError
from jdist.models import get_preset
from jdist.models.layers import dot_product_attention
from jdist.parallel import attention as attn
from jdist.parallel.attention import blockwise as bw
from jdist.parallel.attention.flash import flash_attention
from jdist.tools.equivalence import assert_matches, config, train_steps

RTOL = 1e-5  # max |error| / max |reference|; observed <= ~4e-7
TINY = get_preset("tiny")


def inputs(b=2, s=48, h=8, kv=2, d=16):
    keys = jax.random.split(jax.random.key(1), 4)
    shapes = ((b, s, h, d), (b, s, kv, d), (b, s, kv, d), (b, s, h, d))
    return [jax.random.normal(k, shape) for k, shape in zip(keys, shapes)]


def out_and_grads(attention, q, k, v, cotangent):
    def f(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(out * cotangent), out
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [out, *grads]


@pytest.mark.parametrize("causal, kv, tiles", [  # kv heads 8, 2, 1: MHA, GQA, MQA
    (True, 2, (8, 16)), (True, 1, (16, 8)), (True, 8, (12, 12)),  # tiles skipped or not
    (False, 2, (8, 16)), (False, 8, (48, 48)),                     # one block
])
def test_flash_matches_dense(causal, kv, tiles):
    q, k, v, cotangent = inputs(kv=kv)
    with jax.default_matmul_precision("highest"):
        ref = out_and_grads(lambda q, k, v: dot_product_attention(q, k, v, causal),
                            q, k, v, cotangent)
        got = out_and_grads(lambda q, k, v: flash_attention(
            q, k, v, causal, q_tile=tiles[0], k_tile=tiles[1]), q, k, v, cotangent)
    errors = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, ref)]
    assert max(errors) <= RTOL, errors


def test_flash_with_a_query_offset_attends_like_the_tail_of_the_sequence():
    # What the all-gather strategy runs: local queries placed at `query_offset`.
    q, k, v, _ = inputs()
    with jax.default_matmul_precision("highest"):
        full = dot_product_attention(q, k, v, True)
        tail = flash_attention(q[:, 32:], k, v, True, query_offset=32, q_tile=8, k_tile=8)
    assert float(jnp.max(jnp.abs(tail - full[:, 32:]))) <= RTOL * float(jnp.max(jnp.abs(full)))


def test_causal_flash_skips_the_blocks_above_the_diagonal(monkeypatch):
    # 8 x 8 tiles: the causal forward computes the 36 blocks on or below the diagonal.
    q, k, v, _ = inputs(b=1, s=32, h=1, kv=1, d=8)
    calls = []
    attend = bw.attend

    def counted(*args):  # a host callback per executed block
        jax.debug.callback(lambda: calls.append(1))
        return attend(*args)

    monkeypatch.setattr(bw, "attend", counted)
    counts = []
    for causal in (True, False):
        calls.clear()
        jax.jit(partial(flash_attention, causal=causal, q_tile=4, k_tile=4))(q, k, v)
        jax.effects_barrier()
        counts.append(len(calls))
    assert counts == [36, 64]


def test_auto_picks_by_backend_dtype_and_length():
    pick = lambda **kw: attn.choose("auto", **{"backend": "cpu", "dtype": jnp.float32,
                                               "head_dim": 128, "seq_len": 4096,
                                               "context_parallel": False, **kw})
    assert pick() == "flash"
    assert pick(seq_len=256) == "xla"
    h100 = {"backend": "cuda", "capability": (9, 0), "dtype": jnp.bfloat16}
    assert pick(**h100) == "cudnn"
    assert pick(**{**h100, "dtype": jnp.float32}) == "flash"   # cuDNN needs half precision
    assert pick(**{**h100, "head_dim": 256}) == "cudnn"        # Hopper: up to 256
    assert pick(**{**h100, "head_dim": 256, "capability": (8, 0)}) == "flash"
    assert pick(**{**h100, "capability": (7, 0)}) == "flash"   # cuDNN flash needs Ampere
    assert pick(backend="gpu", dtype=jnp.bfloat16) == "flash"  # a GPU that is not CUDA
    assert pick(**h100, context_parallel=True) == "flash"
    assert pick(**h100, heads_match=False) == "xla"


@pytest.mark.parametrize("kw, message", [
    ({"requested": "cudnn"}, "needs an NVIDIA GPU"),
    ({"requested": "cudnn", "backend": "cuda", "capability": (9, 0)},
     "pass --compute-dtype bfloat16"),
    ({"requested": "cudnn", "backend": "cuda", "capability": (8, 6), "dtype": jnp.bfloat16,
      "head_dim": 192}, "multiple of 8 up to 128"),
    ({"requested": "flash", "heads_match": False}, "heads and kv_heads sharded alike"),
    ({"requested": "xla", "context_parallel": True}, "sequence-sharded"),
    ({"requested": "fused"}, "unknown --attention"),
])
def test_what_cannot_run_is_refused_in_one_line(kw, message):
    args = {"backend": "cpu", "dtype": jnp.float32, "head_dim": 64, "seq_len": 64,
            "context_parallel": False, **kw}
    with pytest.raises(ConfigError, match=message) as e:
        attn.choose(args.pop("requested"), **args)
    assert "\n" not in str(e.value)


def test_training_with_flash_matches_single_device(corpus, single_device):
    # Heads over tensor, batch over data and fsdp; the context-parallel runs are flash too.
    run = train_steps(TINY, "dp=2,fsdp=2,tp=2", corpus.train, config(attention="flash"))
    assert_matches(run, single_device(TINY))
