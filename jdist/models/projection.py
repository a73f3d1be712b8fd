"""A projection `einsum(eq, x, w)` whose weight gradient leaves its matmul in float32.

A weight gradient sums over every token. Where the step splits tokens over a mesh axis
that the weight is replicated over (sequence under context parallelism, expert for the
dense layers of an MoE model), GSPMD adds the devices' partial sums right after the
gradient's matmul, in that matmul's output dtype: bf16 under bf16 compute, before the step
reduces gradients in float32 (GPU program, jax 0.10.2). Here the matmul returns float32
(its accumulator) and the rounding to the weight's dtype comes after, so the partial sums
travel and add in float32. On one device the result is the plain einsum's: one bf16
matmul also accumulates in float32 and rounds once.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jdist.models.precision import accumulator


def transposed(eq: str) -> tuple[str, str]:
    """The equations of x's and w's gradients for `eq` = "x,w->y": "y,w->x", "x,y->w"."""
    operands, y = eq.split("->")
    x, w = operands.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def project(eq: str, x, w):
    return jnp.einsum(eq, x, w)


def _project_fwd(eq, x, w):
    return jnp.einsum(eq, x, w), (x, w)


def weight_grad(eq: str, x, g, w_dtype) -> jax.Array:
    """w's gradient for `eq` = "x,w->y" from y's cotangent `g`: out of its matmul in the
    accumulator's dtype (float32, or wider), rounded to `w_dtype` after (the module doc)."""
    dw = jnp.einsum(transposed(eq)[1], x, g, preferred_element_type=accumulator(x, g))
    return dw.astype(w_dtype)


def _project_bwd(eq, residuals, g):
    x, w = residuals
    return jnp.einsum(transposed(eq)[0], g, w).astype(x.dtype), weight_grad(eq, x, g, w.dtype)


project.defvjp(_project_fwd, _project_bwd)
