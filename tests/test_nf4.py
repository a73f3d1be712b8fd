"""NF4 quantization (jdist.quant.nf4) against an independent numpy reference, written the obvious
way instead of the module's way: tensors flattened to [-1, 64] blocks, the nearest of the 16
values by argmin in float64 (first index on a tie), nibbles packed by hand, an explicit loop
over 256-blocks for double quantization. Plus: sharded == unsharded, storage sizes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.quant import nf4

QUANTIZE = jax.jit(nf4.quantize, static_argnums=(1, 2))  # one compile per shape and setting
DEQUANTIZE = jax.jit(nf4.dequantize)
# bitsandbytes' NF4 code, written out again (not imported) so a typo in one copy shows.
NF4_LITERAL = np.array([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734,
                        -0.0910500, 0.0, 0.0795803, 0.1609302, 0.2461123, 0.3379152,
                        0.4407098, 0.5626170, 0.7229568, 1.0], np.float32)


def reference(w: np.ndarray, double_quant: bool, lead: int, offsets=None) -> dict:
    """Quantize and dequantize like bitsandbytes does, one tensor of the stack at a time.
    `offsets`: use these float32 means (the module's) for the second level - the only
    quantity whose float32 value depends on summation order; checked separately. Decoding
    multiplies by fl32(1/127): what XLA makes of a division by the constant 127."""
    w = np.asarray(w, np.float32)
    stack = w.reshape(math.prod(w.shape[:lead]), -1)
    out = {k: [] for k in ("codes", "absmax", "amcode", "scale", "offset", "deq", "deq_fma")}
    for t, flat in enumerate(stack):
        blocks = flat.reshape(-1, 64)
        absmax = np.abs(blocks).max(axis=1)
        x = blocks / np.where(absmax == 0, np.float32(1), absmax)[:, None]
        dist = np.abs(x.astype(np.float64)[..., None] - NF4_LITERAL.astype(np.float64))
        idx = np.argmin(dist, axis=-1).reshape(-1).astype(np.uint8)
        out["codes"].append((idx[0::2] << 4) | idx[1::2])
        out["absmax"].append(absmax)
        deq_absmax = absmax
        if double_quant:
            exact_mean = np.float32(np.mean(absmax.astype(np.float64)))
            offset = exact_mean if offsets is None else np.float32(np.reshape(offsets, -1)[t])
            np.testing.assert_allclose(offset, exact_mean, rtol=2e-6)
            c = absmax - offset
            amcode = np.zeros(len(c), np.int8)
            scales = []
            deq_absmax = np.zeros(len(c), np.float32)
            fma_absmax = np.zeros(len(c), np.float32)
            for start in range(0, len(c), 256):
                part = c[start:start + 256]
                s = np.abs(part).max()
                q = np.clip(np.round(part / s * np.float32(127)), -127, 127) if s > 0 else 0
                amcode[start:start + 256] = q
                scales.append(s)
                times_s = amcode[start:start + 256].astype(np.float32) * s
                deq_absmax[start:start + 256] = times_s * np.float32(1 / 127) + offset
                # the last multiply and the add fused: float64 holds the product of two
                # float32s exactly (the sum is rounded twice, to float64 then float32: rare)
                fma_absmax[start:start + 256] = (times_s.astype(np.float64)
                                                 * np.float32(1 / 127) + offset)
            out["amcode"].append(amcode)
            out["scale"].append(np.array(scales, np.float32))
            out["offset"].append(offset)
        else:
            fma_absmax = absmax
        for key, am in (("deq", deq_absmax), ("deq_fma", fma_absmax)):
            out[key].append((NF4_LITERAL[idx].reshape(-1, 64) * am[:, None]).reshape(-1))
    rows, n = w.shape[:-1], w.shape[-1]
    res = {"codes": np.stack(out["codes"]).reshape(*rows, n // 2),
           "absmax": np.stack(out["absmax"]).reshape(*rows, n // 64),
           "deq": np.stack(out["deq"]).reshape(w.shape),
           "deq_fma": np.stack(out["deq_fma"]).reshape(w.shape)}
    if double_quant:
        res["amcode"] = np.stack(out["amcode"]).reshape(*rows, n // 64)
        res["scale"] = np.stack(out["scale"]).reshape(*w.shape[:lead], -1)
        res["offset"] = np.array(out["offset"], np.float32).reshape(w.shape[:lead])
    return res


def weights(shape, seed=0, zero_block=False) -> np.ndarray:
    w = np.random.default_rng(seed).normal(0, 0.02, shape).astype(np.float32)
    if zero_block:
        w.reshape(-1, 64)[3] = 0  # one all-zero block (row-major block 3)
    return w


CASES = [  # shape, lead; absmax counts per tensor: 8, 45, 420 (not a multiple of 256), 480
    ((4, 128), 0), ((3, 5, 192), 0), ((12, 7, 320), 0), ((2, 96, 320), 1),
]


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,lead", CASES)
def test_matches_reference(shape, lead, double_quant):
    w = weights(shape, seed=len(shape) + lead, zero_block=True)
    q = QUANTIZE(w, double_quant, lead)
    offsets = None if q.offset is None else np.asarray(q.offset)
    ref = reference(w, double_quant, lead, offsets)
    np.testing.assert_array_equal(np.asarray(q.codes), ref["codes"])
    assert q.codes.dtype == np.uint8
    if double_quant:
        assert q.absmax.dtype == np.int8
        np.testing.assert_array_equal(np.asarray(q.absmax), ref["amcode"])
        np.testing.assert_array_equal(np.asarray(q.scale), ref["scale"])
        np.testing.assert_array_equal(np.asarray(q.offset), ref["offset"])
    else:
        assert q.scale is None and q.offset is None
        np.testing.assert_array_equal(np.asarray(q.absmax), ref["absmax"])
    deq = np.asarray(DEQUANTIZE(q))
    # Identical to the reference with the decoded absmax rounded twice (unoptimised XLA, as
    # in this suite) or, throughout, once (fused multiply-add: optimised CPU and GPU code).
    if not np.array_equal(deq, ref["deq_fma"]):
        np.testing.assert_array_equal(deq, ref["deq"])
    np.testing.assert_array_equal(deq.reshape(-1, 64)[3], 0)  # the zero block decodes to 0
    assert jax.eval_shape(lambda w: nf4.quantize(w, double_quant, lead), w) == nf4.abstract(
        shape, double_quant, lead)


def test_ties_and_exact_values():
    """Every code value decodes to itself; a value exactly halfway between two codes takes
    the lower one; values a float32 ulp off a midpoint take the nearer."""
    v = NF4_LITERAL.astype(np.float64)
    mid = (v[1:] + v[:-1]) / 2
    mid32 = mid.astype(np.float32)
    exact = mid32.astype(np.float64) == mid  # midpoints float32 can hold exactly
    below = np.where(mid32 < mid, mid32, np.nextafter(mid32, np.float32(-2)))
    above = np.where(mid32 > mid, mid32, np.nextafter(mid32, np.float32(2)))
    x = np.concatenate([NF4_LITERAL, mid32[exact], below, above, np.zeros(
        64 - 16 - exact.sum() - 30, np.float32)])
    x[0] = -1.0  # keeps absmax at 1, so the normalised values are these
    want = np.concatenate([np.arange(16), np.arange(15)[exact], np.arange(15),
                           np.arange(1, 16), np.full(64 - 16 - exact.sum() - 30, 7)])
    q = QUANTIZE(x[None], False, 0)
    got = np.asarray(q.codes).reshape(-1)
    np.testing.assert_array_equal(np.stack([got >> 4, got & 15], 1).reshape(-1), want)
    np.testing.assert_array_equal(np.asarray(DEQUANTIZE(q))[0, :16], NF4_LITERAL)


@pytest.mark.parametrize("shape,lead,spec", [
    # both dims sharded, the last in 320 = 5 blocks per shard; the first 256-block of the
    # 24 x 20 absmax values (rows 0-12.8) straddles the two "a" shards (rows 0-11, 12-23)
    ((24, 1280), 0, P("a", "b")),
    ((2, 64, 256), 1, P("a", "b", None)),  # a stack of 2 tensors, one per "a" shard
])
def test_sharded_equals_unsharded(shape, lead, spec):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"),
                axis_types=(AxisType.Auto,) * 2)
    w = weights(shape, seed=7)
    plain = QUANTIZE(w, True, lead)
    named = NamedSharding(mesh, spec)
    stat = NamedSharding(mesh, P(*spec[:lead]))
    out = nf4.Nf4(named, named, stat, stat)
    fn = jax.jit(lambda w: nf4.quantize(w, True, lead), in_shardings=named, out_shardings=out)
    compiled = fn.lower(jax.device_put(w, named)).compile()
    assert "all-gather" not in compiled.as_text()  # each shard quantizes its own blocks
    sharded = compiled(jax.device_put(w, named))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    deq = jax.jit(nf4.dequantize, out_shardings=named)(sharded)
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(DEQUANTIZE(plain)))


@pytest.mark.parametrize("shape,lead", [((8192, 64, 128), 0), ((8192, 28672), 0),
                                        ((28672, 8192), 0), ((80, 8192, 28672), 1)])
def test_bytes_per_param_llama70b(shape, lead):
    n = math.prod(shape)
    n_absmax = n // 64
    # codes + int8 absmax + one float32 scale per 256 absmax + one float32 offset per tensor
    tensors = math.prod(shape[:lead])
    want = (n // 2 + n_absmax + 4 * tensors * -(-n_absmax // tensors // 256) + 4 * tensors) / n
    got = nf4.bytes_per_param(shape, True, lead)
    assert 0.51 < got < 0.53 and got == pytest.approx(want, rel=1e-12)
    leaves = jax.tree.leaves(jax.eval_shape(lambda w: nf4.quantize(w, True, lead),
                                            jax.ShapeDtypeStruct(shape, jnp.bfloat16)))
    assert sum(x.size * x.dtype.itemsize for x in leaves) == pytest.approx(want * n, rel=1e-12)
    assert nf4.bytes_per_param(shape, False, lead) == 0.5 + 4 / 64


def test_bytes_per_param_matches_arrays():
    shape = (3, 5, 192)
    for dq in (False, True):
        q = QUANTIZE(weights(shape), dq, 0)
        size = sum(np.asarray(x).nbytes for x in jax.tree.leaves(q))
        assert nf4.bytes_per_param(shape, dq) == size / math.prod(shape)


def test_last_dim_not_multiple_of_64():
    with pytest.raises(ValueError, match="divisible by 64"):
        nf4.quantize(jnp.zeros((4, 96)))
    with pytest.raises(ValueError, match="divisible by 64"):
        nf4.abstract((4, 96), True)
