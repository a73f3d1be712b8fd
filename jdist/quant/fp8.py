"""FP8 projections (`--fp8 tensorwise|rowwise`): each of a block projection's three matmuls
(y = x w, dx = g wᵀ, dw = xᵀ g) on float8 operands, accumulated in float32.

Every matmul quantizes both of its operands with a scale from their current amax: forward
operands (x, w) to e4m3, the output's cotangent g to e5m2 (range over precision). The
amax is taken over the whole tensor (`tensorwise`) or over that matmul's contracted
dimensions only, one scale per row of the others (`rowwise`: a token's row of x for the
forward, a weight column, and for dw a feature over all tokens). The float32 product is
multiplied by the two scales and rounded to the compute dtype. Nothing is kept between
steps (current scaling, not delayed: no amax history to carry, checkpoint or get wrong).

Scales are powers of two, so rescaling is exact and a value's quantization depends on the
amax alone. The amax is the tensor's, not the shard's: `jnp.max` over the global array
where the partitioner splits it, and `pmax` over the manual mesh axes a reduced dimension
is split over (the step's replica axes split the batch), so the quantized operands, and
the result up to float32 summation order, do not depend on the mesh. The backward
quantizes again from the kept compute-dtype x and w: a recomputed forward quantizes
identically.

The dot takes the float8 operands themselves (`jnp.einsum` with `preferred_element_type`
float32; e4m3 by e5m2 in the backward): XLA's GPU compiler emits an FP8 gemm for it, and
the CPU computes the same products exactly (float8 values are exact in float32) with a
float32 accumulator. A dot of float8 values converted to the compute dtype first is not
the same program on the GPU: XLA fuses the converts into a bf16 Triton gemm (H100 target,
jax 0.10.2). Flax's `fp8_ops` keep delayed-scaling state (amax histories updated through
the gradient) in a linen module; current scaling needs none of it, so this is a function
over `jnp.einsum`.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdist.models.precision import accumulator
from jdist.models.projection import transposed, weight_grad
from jdist.spmd import axes as ax
from jdist.spmd.varying import alike

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MODES = ("tensorwise", "rowwise")


def scale_of(a, dtype, axes: tuple[int, ...], manual: tuple[str, ...] = ()) -> jax.Array:
    """The power-of-two scale s (dtype `accumulator(a)`), per slice of `a` over `axes`
    (kept as size-1 dims), with |a| / s <= the largest finite `dtype`; `manual`: mesh axes
    (manual here) that split a reduced dimension, whose shards' amaxes are combined."""
    amax = jnp.max(jnp.abs(a.astype(accumulator(a))), axis=axes, keepdims=True)
    if manual:
        amax = jax.lax.pmax(amax, manual)
    # amax / max = m * 2^e with m in [0.5, 1): a / 2^e fits; exact, no log rounding.
    _, e = jnp.frexp(amax / float(jnp.finfo(dtype).max))
    one = jnp.ones((), amax.dtype)
    return jnp.where((amax > 0) & jnp.isfinite(amax), jnp.ldexp(one, e), one)


def quantize(a, dtype, scale) -> jax.Array:
    """`a / scale` in `dtype`, saturating (a scale from a stale or smaller amax clips
    rather than overflows)."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(a.astype(accumulator(a)) / scale, -limit, limit).astype(dtype)


def scaled_einsum(eq: str, a, a_dtype, b, b_dtype, mode: str,
                  manual: dict[str, tuple[str, ...]], keep: str = "") -> jax.Array:
    """`einsum(eq, a, b)` in `accumulator(a)` from `a` and `b` quantized to `a_dtype`/`b_dtype`.
    `manual`: subscript letter -> the manual mesh axes that dimension is split over.
    `keep`: letters whose every slice has scales of its own in either mode (an expert's
    weights, a token's row)."""
    operands, out = eq.split("->")
    subs = operands.split(",")
    contracted = set(subs[0]) & set(subs[1]) - set(out)
    quantized, scales = [], []
    for x, sub, dtype in ((a, subs[0], a_dtype), (b, subs[1], b_dtype)):
        reduced = [i for i, c in enumerate(sub) if c not in keep
                   and (mode == "tensorwise" or c in contracted)]
        axes = tuple(dict.fromkeys(m for i in reduced for m in manual.get(sub[i], ())))
        s = scale_of(x, dtype, tuple(reduced), axes)
        quantized.append(quantize(x, dtype, s))
        scales.append(s)
    y = jnp.einsum(eq, *quantized, preferred_element_type=accumulator(a))
    # The scales have size 1 on the contracted dims: their einsum is the outer product of
    # the two, laid out as y (exact: powers of two).
    return y * jnp.einsum(eq, *scales)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def project(eq: str, mode: str, manual: tuple, x, w):
    """`einsum(eq, x, w)` in FP8 (module doc); `manual`: (letter, mesh axes) pairs, as
    `scaled_einsum`'s (a tuple, to be hashable)."""
    return scaled_einsum(eq, x, E4M3, w, E4M3, mode, dict(manual)).astype(x.dtype)


def _project_fwd(eq, mode, manual, x, w):
    return project(eq, mode, manual, x, w), (x, w)


def _project_bwd(eq, mode, manual, residuals, g):
    x, w = residuals
    to_x, to_w = transposed(eq)
    split = dict(manual)
    dx = scaled_einsum(to_x, g, E5M2, w, E4M3, mode, split)
    # The weight gradient leaves its matmul in float32, as `models.projection.project`'s.
    dw = scaled_einsum(to_w, x, E4M3, g, E5M2, mode, split)
    return dx.astype(x.dtype), dw.astype(w.dtype)


project.defvjp(_project_fwd, _project_bwd)


def hooks(mode: str, batch_axes: tuple[str, ...]) -> dict:
    """`ModelContext.widen`/`narrow` in FP8. `batch_axes`: the manual mesh axes the step
    splits the batch over (the dimension the model names `BATCH`)."""
    def split(sub: str, names) -> tuple:
        return tuple((c, tuple(batch_axes)) for c, n in zip(sub, names)
                     if n == ax.BATCH and batch_axes)

    def widen(x, ws, eq, out_names):
        out_sub = eq.split("->")[1]
        return tuple(project(eq, mode, split(out_sub, names), x, w)
                     for w, names in zip(ws, out_names))

    def narrow(h, w, eq, h_names):
        return project(eq, mode, split(eq.split(",")[0], h_names), h, w)

    return {"widen": widen, "narrow": narrow}


class ExpertDot(NamedTuple):
    """An expert matmul's forward and input-gradient einsums in FP8 (hashable: a custom
    VJP's static argument). Every row and every expert has scales of its own (`keep`), in
    either mode: an expert's rows meet its weights in blocks, rounds and devices that
    depend on the routing and the mesh, and a row's scale depends on nothing else. For the
    same reason the weight gradient, a sum over an expert's rows wherever they landed,
    stays in the compute dtype. `manual`: (letter, tensor axes) for the hidden dimension,
    split over tensor inside the expert kernel."""
    mode: str
    keep: str
    manual: tuple

    def forward(self, eq: str, x, w) -> jax.Array:
        return scaled_einsum(eq, x, E4M3, w, E4M3, self.mode, dict(self.manual),
                             self.keep).astype(x.dtype)

    def input_grad(self, eq: str, g, w) -> jax.Array:
        return scaled_einsum(eq, g, E5M2, w, E4M3, self.mode, dict(self.manual),
                             self.keep).astype(g.dtype)

    def project(self, eq: str, x, w) -> jax.Array:
        """`einsum(eq, x, w)` with this forward and input gradient (the padded paths)."""
        return _expert_project(self, eq, *alike(x, w))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _expert_project(dot: ExpertDot, eq: str, x, w):
    return dot.forward(eq, x, w)


def _expert_project_fwd(dot, eq, x, w):
    return dot.forward(eq, x, w), (x, w)


def _expert_project_bwd(dot, eq, residuals, g):
    x, w = residuals
    return dot.input_grad(transposed(eq)[0], g, w).astype(x.dtype), \
        weight_grad(eq, x, g, w.dtype)


_expert_project.defvjp(_expert_project_fwd, _expert_project_bwd)


class ExpertDots(NamedTuple):
    """What the expert layers run in FP8: the blocked (grouped) path's gate/up and down
    matmuls ("gbd,gdf->gbf", the hidden dimension f for gate/up and d for down) and the
    padded paths' per-expert buffers ("ecd,edf->ecf" and "ecf,efd->ecd")."""
    grouped_in: ExpertDot
    grouped_out: ExpertDot
    padded: ExpertDot


def expert_dots(mode: str, tp_axes: tuple[str, ...]) -> ExpertDots:
    tp = tuple(tp_axes)
    hidden = lambda letter: ((letter, tp),) if tp else ()
    return ExpertDots(ExpertDot(mode, "gb", hidden("f")), ExpertDot(mode, "gb", hidden("d")),
                      ExpertDot(mode, "ec", hidden("f")))
