"""models.projection: the model's projections, with weight gradients out of the matmul in
float32. Every layout and the one-device reference share it, so the equivalence suite
cannot see a wrong gradient here: it is checked against autodiff of the plain einsum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.models.projection import project

EQUATIONS = {  # the model's: q/k/v, attention output, gate/up, down
    "bsd,dhk->bshk": ((2, 8, 16), (16, 4, 8)),
    "bshd,hde->bse": ((2, 8, 4, 8), (4, 8, 16)),
    "bse,ef->bsf": ((2, 8, 16), (16, 32)),
}


@pytest.mark.parametrize("eq", EQUATIONS)
def test_gradients_are_the_einsums(eq):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x_shape, w_shape = EQUATIONS[eq]
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    out = jnp.einsum(eq, x, w)
    g = jax.random.normal(kg, out.shape)
    with jax.default_matmul_precision("highest"):
        got, pull = jax.vjp(lambda x, w: project(eq, x, w), x, w)
        want, pull_ref = jax.vjp(lambda x, w: jnp.einsum(eq, x, w), x, w)
        grads, ref = pull(g), pull_ref(g)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_weight_gradient_rounds_once():
    """In bf16 the gradients keep their operands' dtypes, and the weight's is the float32
    product rounded once. (That its partial sums over a token axis travel in float32 is
    read from the GPU program: tests/test_gpu_target.py, check_token_axis_gradients.)"""
    eq = "bse,ef->bsf"
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (2, 64, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (16, 32)).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (2, 64, 32)).astype(jnp.bfloat16)
    _, pull = jax.vjp(lambda x, w: project(eq, x, w), x, w)
    dx, dw = pull(g)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    exact = jnp.einsum("bse,bsf->ef", x.astype(jnp.float32), g.astype(jnp.float32),
                       precision="highest")
    np.testing.assert_array_equal(dw, exact.astype(jnp.bfloat16))
