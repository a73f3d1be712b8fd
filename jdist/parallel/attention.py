"""Which attention implementation a step runs when the sequence is not sharded, and the
kernels themselves: `xla` (the model's dense reference), `flash` (pure-JAX blockwise,
`jdist.parallel.flash`), `cudnn` (`jax.nn.dot_product_attention` on NVIDIA GPUs).

`auto` picks cudnn where it can run, else flash from `FLASH_MIN_SEQ` tokens, else xla. A
sharded sequence always runs the context-parallel strategy, whose local blocks are the
flash kernel's (`jdist.parallel.context`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jdist.errors import ConfigError, require
from jdist.parallel import CHECK_VMA, kernel_mesh
from jdist.parallel.flash import flash_attention

AUTO, XLA, FLASH, CUDNN = "auto", "xla", "flash", "cudnn"
IMPLEMENTATIONS = (AUTO, XLA, FLASH, CUDNN)
# Below this many tokens the dense [S, S] scores are small (1024^2 float32 = 4 MiB per
# head), and one block beats a loop of tiles; above it, flash's O(S) memory wins.
FLASH_MIN_SEQ = 1024
# cuDNN's fused attention (cuDNN 9, jax 0.10/0.11): half precision, head_dim a multiple
# of 8 up to 128.
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


def cudnn_refusal(backend: str, dtype, head_dim: int) -> str | None:
    """Why cuDNN attention cannot run this, or None if it can."""
    if backend not in ("gpu", "cuda"):
        return f"cuDNN attention needs an NVIDIA GPU (this backend is {backend})"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return (f"cuDNN attention needs bfloat16 or float16 compute (this run uses "
                f"{jnp.dtype(dtype).name}; pass --compute-dtype bfloat16)")
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN attention needs a head dimension that is a multiple of 8 up to "
                f"{CUDNN_MAX_HEAD_DIM} (this model's is {head_dim})")
    return None


def choose(requested: str, *, backend: str, dtype, head_dim: int, seq_len: int,
           context_parallel: bool) -> str:
    """The implementation that runs: `requested`, or what `auto` resolves to. One-line
    ConfigError where the request cannot run."""
    require(requested in IMPLEMENTATIONS,
            f"unknown --attention {requested!r}; use {', '.join(IMPLEMENTATIONS)}")
    if context_parallel:
        require(requested in (AUTO, FLASH),
                f"--attention {requested} cannot run on a sequence-sharded mesh (the "
                "context-parallel kernel runs flash blocks); use --attention flash or auto")
        return FLASH
    if requested == CUDNN:
        why = cudnn_refusal(backend, dtype, head_dim)
        if why:
            raise ConfigError(f"--attention cudnn: {why}; use --attention flash or auto")
        return CUDNN
    if requested != AUTO:
        return requested
    if cudnn_refusal(backend, dtype, head_dim) is None:
        return CUDNN
    return FLASH if seq_len >= FLASH_MIN_SEQ else XLA


def cudnn_attention(q, k, v, causal: bool = True):
    """q [b, s, h, d], k/v [b, t, kv, d] (GQA native) through cuDNN's fused kernel."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _local(fn, q_spec, kv_spec, mesh, q, k, v, causal):
    """`fn` per device, over the batch/head shards the specs give (the sequence whole)."""
    return jax.shard_map(partial(fn, causal=causal), **kernel_mesh(mesh),
                         in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=CHECK_VMA)(q, k, v)


def kernel(name: str, *, mesh, q_spec, kv_spec):
    """`attention(q, k, v, causal)` for `ModelContext.attention`; None for xla (the model's
    own dense path, partitioned by GSPMD)."""
    if name == XLA:
        return None
    fn = {FLASH: flash_attention, CUDNN: cudnn_attention}[name]
    return lambda q, k, v, causal=True: _local(fn, q_spec, kv_spec, mesh, q, k, v, causal)
