"""The dtype every sum accumulates in: float32, or the operands' dtype where it is wider.

Matmul accumulators, norms, softmax statistics and the loss reduce in float32 whatever the
compute dtype (bf16 sums would round away the small terms). Under `--compute-dtype float64`
they reduce in float64, so a verification run has no float32 step anywhere whose summation
order could differ between meshes: FP8's quantization turns such 1e-7 differences into
whole-code flips (tests/test_fp8.py)."""

from __future__ import annotations

import functools

import jax.numpy as jnp


def accumulator(*arrays) -> jnp.dtype:
    """float32, or the widest of `arrays`' dtypes (arrays or dtypes) where wider."""
    dtypes = (jnp.dtype(getattr(a, "dtype", a)) for a in arrays)
    return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))
