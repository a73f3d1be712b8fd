"""The grouped matmul's Pallas kernels (`--expert-matmul kernel`): exact against the loop
on the CPU (interpreted), and on the H100 compiler one Triton kernel per projection and pass
instead of a loop of per-block matmuls."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.errors import ConfigError
from jdist.models.grouped import grouped_swiglu
from jdist.models.grouped_kernel import Kernel
from jdist.tools.gpu_report import report

INTERPRET = Kernel(interpret=True, required=True)


def experts_layer(t=96, n_experts=8, k=2, d=64, f=32, dtype=jnp.float32, used=None):
    """Tokens, their expert ids [T, k] (distinct for k <= 2, among the first `used` experts: the
    others get none) and the weights gate, up [E, d, f] and down [E, f, d]."""
    used = used or n_experts
    keys = jax.random.split(jax.random.key(0), 5)
    first, other = jax.random.randint(keys[0], (2, t), 0, used)
    ids = jnp.stack([(first + j * (1 + other % (used - 1))) % used for j in range(k)], -1)
    w = [jax.random.normal(key, shape, dtype) / shape[1] ** 0.5 for key, shape in
         zip(keys[1:4], ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d)))]
    return jax.random.normal(keys[4], (t, d), dtype), ids.astype(jnp.int32), w


def test_kernels_match_the_loop():
    """Forward and every gradient at 1e-6 against the loop of per-block matmuls, float32,
    with routing that leaves some experts without a token."""
    x, ids, w = experts_layer(used=5)
    probe = jax.random.normal(jax.random.key(1), (x.shape[0], ids.shape[1], x.shape[1]))

    def run(kernel):
        def both(x, *w):
            out, vjp = jax.vjp(lambda x, *w: grouped_swiglu(x, ids, *w, kernel=kernel), x, *w)
            return out, vjp(probe)

        with jax.default_matmul_precision("highest"):
            return jax.jit(both)(x, *w)

    (out, grads), (ref, ref_grads) = run(INTERPRET), run(None)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))


def test_kernel_refuses_shapes_it_cannot_tile():
    x, ids, w = experts_layer(f=24)
    run = lambda kernel: jax.eval_shape(
        lambda x, *w: grouped_swiglu(x, ids, *w, kernel=kernel), x, *w)
    with pytest.raises(ConfigError, match="multiples of 16.*--expert-matmul loop"):
        run(INTERPRET)
    # Chosen by auto, not asked for: the loop instead.
    assert run(Kernel(interpret=True, required=False)).shape == (*ids.shape, x.shape[1])


@pytest.mark.gpu_compiler
def test_kernels_compile_for_h100_as_one_kernel_per_matmul():
    """The forward and backward of the three projections: nine Triton kernels (forward,
    input and weight gradient each), no dot, none in a loop; their FLOPs counted by
    gpu_report (the blocks' rows: the routed ones and their padding)."""
    from jax.sharding import Mesh, SingleDeviceSharding

    from jdist.runtime.target import COMPILER_OPTIONS, devices

    device = devices("h100-80gb", 1)[0]
    t, n_experts, k, d, f = 512, 8, 2, 64, 32
    x, ids, w = experts_layer(t, n_experts, k, d, f, jnp.bfloat16)
    kernel = Kernel(interpret=False, required=True)
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
    loss = lambda x, ids, *w: jnp.sum(grouped_swiglu(x, ids, *w, kernel=kernel)
                                      .astype(jnp.float32) ** 2)
    text = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).lower(
        *map(spec, (x, ids, *w))).compile(dict(COMPILER_OPTIONS)).as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', text)
    assert targets.count("__gpu$xla.gpu.triton") == 9, targets
    assert " dot(" not in text
    rep = report(text, Mesh(np.array([device]), ("data",)))
    assert rep.gemms == 9  # each run once: none in a loop
    rows = rep.executed_flops / (3 * 3 * 2 * d * f)  # rows each of the nine matmuls ran
    assert t * k <= rows <= 1.25 * t * k, rows
