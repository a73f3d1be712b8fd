"""Which attention implementation a step runs when the sequence is not sharded, and the
kernels themselves: `xla` (the model's dense reference), `flash` (pure-JAX blockwise,
`jdist.parallel.attention.flash`), `cudnn` (`jax.nn.dot_product_attention` on NVIDIA GPUs).

`auto` picks cudnn where it can run, else flash from `FLASH_MIN_SEQ` tokens, else xla. A
sharded sequence always runs the context-parallel strategy, whose local blocks are the
flash kernel's (`jdist.parallel.attention.context`).

Every kernel takes a sliding `window` (a static int per call) and learned `sinks` [heads].
cuDNN's fused kernel as jax 0.10-0.12 exposes it has a window (`local_window_size`) but no
sinks, so a model with sinks runs flash there (`SINKS_ON_CUDNN` says so).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jdist.errors import ConfigError, require
from jdist.parallel import CHECK_VMA, kernel_mesh
from jdist.parallel.attention.flash import flash_attention

AUTO, XLA, FLASH, CUDNN = "auto", "xla", "flash", "cudnn"
IMPLEMENTATIONS = (AUTO, XLA, FLASH, CUDNN)
# Below this many tokens the dense [S, S] scores are small (1024^2 float32 = 4 MiB per
# head), and one block beats a loop of tiles; above it, flash's O(S) memory wins.
FLASH_MIN_SEQ = 1024
# cuDNN's fused attention as jax 0.10/0.11 runs it: an NVIDIA GPU from Ampere (8.0), half
# precision, head_dim a multiple of 8 up to 128 (256 from Hopper, 9.0).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
SINKS_ON_CUDNN = ("--attention cudnn: jax's cuDNN attention has no attention sinks (jax "
                  "0.10.2 to 0.12), so this model's attention runs flash")


def accelerator(device=None) -> tuple[str, tuple[int, ...]]:
    """("cuda", compute capability) for an NVIDIA GPU, a real one or a deviceless target's
    (`jdist.runtime.target`); else (the platform's name, ()). Default: jax's first device."""
    from jdist.runtime import target

    device = device or jax.devices()[0]
    nvidia = target.is_compile_only(device) or "cuda" in device.client.platform_version.lower()
    if device.platform == "gpu" and nvidia:
        return "cuda", target.capability_of(device)
    return device.platform, ()


def cudnn_refusal(backend: str, dtype, head_dim: int, capability: tuple = ()) -> str | None:
    """Why cuDNN attention cannot run this, or None if it can."""
    if backend != "cuda":
        return f"cuDNN attention needs an NVIDIA GPU (this backend is {backend})"
    if capability < (8, 0):
        return (f"cuDNN attention needs compute capability 8.0 or newer (this GPU has "
                f"{'.'.join(map(str, capability))})")
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return (f"cuDNN attention needs bfloat16 or float16 compute (this run uses "
                f"{jnp.dtype(dtype).name}; pass --compute-dtype bfloat16)")
    limit = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > limit:
        return (f"cuDNN attention needs a head dimension that is a multiple of 8 up to "
                f"{limit} on this GPU (this model's is {head_dim})")
    return None


def choose(requested: str, *, backend: str, dtype, head_dim: int, seq_len: int,
           context_parallel: bool, capability: tuple = (), heads_match: bool = True,
           sinks: bool = False) -> str:
    """The implementation that runs: `requested`, or what `auto` resolves to. One-line
    ConfigError where the request cannot run. `heads_match`: the rules shard heads and
    kv_heads alike (the kernels pair each device's query heads with its kv heads). `sinks`:
    the model has attention sinks, which cuDNN cannot run (flash runs instead)."""
    require(requested in IMPLEMENTATIONS,
            f"unknown --attention {requested!r}; use {', '.join(IMPLEMENTATIONS)}")
    if context_parallel:
        require(requested in (AUTO, FLASH),
                f"--attention {requested} cannot run on a sequence-sharded mesh (the "
                "context-parallel kernel runs flash blocks); use --attention flash or auto")
        return FLASH
    if not heads_match:
        require(requested in (AUTO, XLA),
                f"--attention {requested} needs heads and kv_heads sharded alike, which the "
                "rules do not do; give both the same rules or use --attention xla")
        return XLA
    if requested == CUDNN:
        why = cudnn_refusal(backend, dtype, head_dim, capability)
        if why:
            raise ConfigError(f"--attention cudnn: {why}; use --attention flash or auto")
        return FLASH if sinks else CUDNN
    if requested != AUTO:
        return requested
    if cudnn_refusal(backend, dtype, head_dim, capability) is None and not sinks:
        return CUDNN
    return FLASH if seq_len >= FLASH_MIN_SEQ else XLA


def cudnn_attention(q, k, v, causal: bool = True, segment_ids=None, window=None,
                    implementation: str = "cudnn"):
    """q [b, s, h, d], k/v [b, t, kv, d] (GQA native) through cuDNN's fused kernel. Packed
    documents pass a [b, 1, s, t] boolean mask built from `segment_ids` (cuDNN's fused
    kernel takes masks; not yet run on a GPU by jdist's tests). A sliding `window` is
    cuDNN's (left, right) local window: `window` - 1 keys back, none ahead.
    `implementation`: "xla" runs the same call on any backend (the tests)."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        local_window_size=local, implementation=implementation)


def _local(fn, q_spec, kv_spec, mesh, q, k, v, causal, segment_ids=None, window=None,
           sinks=None):
    """`fn` per device, over the batch/head shards the specs give (the sequence whole);
    `sinks` [heads] split as the heads are."""
    seg = () if segment_ids is None else (segment_ids,)
    seg_specs = (PartitionSpec(*q_spec[:2]),) * len(seg)
    sink = () if sinks is None else (sinks,)
    sink_specs = (PartitionSpec(q_spec[2]),) * len(sink)

    def call(q, k, v, *rest):
        extra = {"window": window} if window is not None else {}
        if sink:
            extra["sinks"] = rest[-1]
        return fn(q, k, v, causal, *rest[:len(seg)], **extra)
    return jax.shard_map(call, **kernel_mesh(mesh),
                         in_specs=(q_spec, kv_spec, kv_spec, *seg_specs, *sink_specs),
                         out_specs=q_spec, check_vma=CHECK_VMA)(q, k, v, *seg, *sink)


def _flash_segments(q, k, v, causal, segment_ids=None, window=None, sinks=None):
    return flash_attention(q, k, v, causal, segment_ids=segment_ids, window=window,
                           sinks=sinks)


def kernel(name: str, *, mesh, q_spec, kv_spec):
    """`attention(q, k, v, causal, segment_ids=None, window=None, sinks=None)` for
    `ModelContext.attention`; None for xla (the model's own dense path, partitioned by
    GSPMD). `choose` never picks cudnn for a model with sinks."""
    if name == XLA:
        return None
    fn = {FLASH: _flash_segments, CUDNN: cudnn_attention}[name]
    return lambda q, k, v, causal=True, segment_ids=None, window=None, sinks=None: _local(
        fn, q_spec, kv_spec, mesh, q, k, v, causal, segment_ids, window, sinks)
