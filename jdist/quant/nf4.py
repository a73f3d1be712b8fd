"""NF4 (4-bit NormalFloat) weight quantization, as in QLoRA / bitsandbytes, in pure JAX.

Blocks of 64 consecutive elements run along the LAST dimension, so a tensor sharded over any
dimension (the last one in pieces that are multiples of 64) keeps each block inside one shard
and quantizes to the same bits on every mesh. For the same reason nothing here merges
dimensions: only the last one is split (and merged back); block ids of the second level come
from iota indices and row-major strides, maxima from a scatter-max and scales from a take, so
GSPMD partitions every step without gathering the weight.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# bitsandbytes' NF4 code: quantiles of N(0, 1) rescaled to [-1, 1], with an exact zero.
VALUES = np.array([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734,
                   -0.0910500, 0.0, 0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098,
                   0.5626170, 0.7229568, 1.0], np.float32)
BLOCK = 64  # weights per float32 absmax (first level)
DQ_BLOCK = 256  # absmax values per float32 scale (second level, double quantization)


def _midpoints() -> np.ndarray:
    """The exact midpoints between neighbouring values, rounded DOWN to float32: for a float32
    x, `x > m32` then holds exactly when x lies above the true midpoint, so the code is the
    nearest value with ties to the lower index (rounding to nearest could misplace an x in
    the half-ulp between the float32 and the exact midpoint)."""
    exact = (VALUES[1:].astype(np.float64) + VALUES[:-1]) / 2
    m32 = exact.astype(np.float32)
    return np.where(m32 > exact, np.nextafter(m32, np.float32(-np.inf)), m32)


_MIDPOINTS = _midpoints()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Nf4:
    """A quantized tensor [..., n]: see `quantize` for the meaning and shape of each field."""

    codes: jax.Array  # uint8 [..., n/2]: element 2j in the high nibble, 2j+1 in the low
    absmax: jax.Array  # float32 [..., n/64], or int8 codes with double quantization
    scale: jax.Array | None = None  # float32 [*lead, ceil(M/256)] with double quantization
    offset: jax.Array | None = None  # float32 [*lead]: mean absmax, with double quantization

    def dequantize(self, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
        """The weight in `dtype` (a layer calls this where it uses the weight, so only that
        projection exists in full: `models.layers.weight`)."""
        return dequantize(self, dtype)


def _check(shape: tuple[int, ...], lead: int) -> None:
    if not shape or shape[-1] % BLOCK or not 0 <= lead < len(shape):
        raise ValueError(f"NF4 needs a last dim divisible by {BLOCK} and 0 <= lead < ndim; "
                         f"got shape {tuple(shape)}, lead={lead}")


def _block_ids(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major flat index // DQ_BLOCK, from iotas (no reshape to flatten)."""
    if math.prod(shape) >= 2**31:
        raise ValueError(f"{math.prod(shape)} absmax values per tensor overflow int32 ids")
    flat = jnp.zeros(shape, jnp.int32)
    for dim, stride in enumerate(np.cumprod((shape + (1,))[:0:-1])[::-1]):
        flat = flat + jax.lax.broadcasted_iota(jnp.int32, shape, dim) * int(stride)
    return flat // DQ_BLOCK


def _n_scales(shape: tuple[int, ...]) -> int:
    return -(-math.prod(shape) // DQ_BLOCK)


def _vmap(fn, lead: int):
    for _ in range(lead):
        fn = jax.vmap(fn)
    return fn


def _mean(a: jax.Array) -> jax.Array:
    """The mean of non-negative `a`, with bits that do not depend on summation order, so
    neither on the mesh: a float32 sum is reassociated by every sharding (partial sums per
    shard, then an all-reduce) and its last bit, through the offset, moves every absmax.
    Each value becomes a fixed-point integer, 24 bits below a power of two above the maximum
    (exact scaling, then rounding: unbiased); integer sums are associative.
    Limbs of `bits` bits keep every int32 sum below 2**31. Within a few ulps of the mean."""
    m = a.size
    if m >= 2**30:
        raise ValueError(f"{m} absmax values per tensor: too many for int32 sums")
    bits = 31 - m.bit_length()  # m * 2**bits <= 2**31
    # max < 2**(e - 126) for its biased exponent e (clamped: a max under 2**-103 sums to ~0).
    e = jnp.maximum(jax.lax.bitcast_convert_type(jnp.max(a), jnp.int32) >> 23, 24)
    up, down = (jax.lax.bitcast_convert_type(x << 23, jnp.float32) for x in (277 - e, e - 23))
    fixed = jnp.round(a * up).astype(jnp.int32)  # a * 2**(150 - e) is exact: [0, 2**24]
    total = jnp.float32(0)
    for k in range(-(-25 // bits)):
        limb = (fixed >> (k * bits)) & ((1 << bits) - 1)
        total = total + jnp.sum(limb).astype(jnp.float32) * np.float32(2.0 ** (k * bits))
    return total * down / m


def _quantize_absmax(absmax: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tensor's absmax -> (int8 codes, float32 scales, offset). Subtracting the mean
    centres the (all positive) values so the int8 grid covers their spread, not [0, max]."""
    offset = _mean(absmax)
    c = absmax - offset
    ids = _block_ids(absmax.shape)
    scale = jnp.zeros(_n_scales(absmax.shape), jnp.float32).at[ids].max(jnp.abs(c))
    s = jnp.take(scale, ids)
    # jnp.round is round-half-to-even; a zero scale means c == 0 throughout the block.
    code = jnp.where(s > 0, jnp.round(c / jnp.where(s > 0, s, 1) * 127), 0)
    return jnp.clip(code, -127, 127).astype(jnp.int8), scale, offset


def quantize(w: jax.Array, double_quant: bool = False, lead: int = 0) -> Nf4:
    """w [..., n] (n % 64 == 0) -> Nf4. `lead` leading dims are a stack of independent
    tensors (e.g. layers): double-quantization statistics are kept per lead index. The codes
    come from the exact float32 absmax even with double quantization, as bitsandbytes does."""
    w = jnp.asarray(w)
    _check(w.shape, lead)
    blocks = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    x = blocks / jnp.where(absmax > 0, absmax, 1)[..., None]  # an all-zero block stays 0
    code = sum((x > m).astype(jnp.uint8) for m in _MIDPOINTS)  # strict: ties go lower
    pairs = code.reshape(*code.shape[:-1], BLOCK // 2, 2)
    packed = (pairs[..., 0] << 4) | pairs[..., 1]
    codes = packed.reshape(*w.shape[:-1], w.shape[-1] // 2)
    if not double_quant:
        return Nf4(codes, absmax)
    return Nf4(codes, *_vmap(_quantize_absmax, lead)(absmax))


def _absmax(q: Nf4) -> jax.Array:
    """The float32 absmax, decoding the second level where there is one."""
    if q.scale is None:
        return q.absmax.astype(jnp.float32)
    lead = q.scale.ndim - 1

    def one(code: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
        # XLA turns `/ 127` into `* fl32(1/127)` anyway; spelling that out pins the bits (up
        # to the last multiply and the add, which optimised CPU and GPU code fuse to an FMA).
        step = jnp.take(scale, _block_ids(code.shape))
        return code.astype(jnp.float32) * step * np.float32(1 / 127) + offset

    return _vmap(one, lead)(q.absmax, q.scale, q.offset)


def dequantize(q: Nf4, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
    """Nf4 -> [..., n] in `dtype` (computed in float32, cast at the end)."""
    *rest, half = q.codes.shape
    pairs = q.codes.reshape(*rest, half * 2 // BLOCK, BLOCK // 2)
    code = jnp.stack([pairs >> 4, pairs & 15], axis=-1).reshape(*pairs.shape[:-1], BLOCK)
    w = _absmax(q)[..., None] * jnp.take(jnp.asarray(VALUES), code.astype(jnp.int32))
    return w.reshape(*rest, half * 2).astype(dtype)


def abstract(shape: tuple[int, ...], double_quant: bool, lead: int = 0) -> Nf4:
    """`quantize`'s output as ShapeDtypeStructs, to plan memory and shardings without arrays."""
    shape = tuple(shape)
    _check(shape, lead)
    sds = jax.ShapeDtypeStruct
    codes = sds((*shape[:-1], shape[-1] // 2), jnp.uint8)
    am_shape = (*shape[:-1], shape[-1] // BLOCK)
    if not double_quant:
        return Nf4(codes, sds(am_shape, jnp.float32))
    return Nf4(codes, sds(am_shape, jnp.int8),
               sds((*shape[:lead], _n_scales(am_shape[lead:])), jnp.float32),
               sds(shape[:lead], jnp.float32))


def bytes_per_param(shape: tuple[int, ...], double_quant: bool, lead: int = 0) -> float:
    """Stored bytes per weight: 0.5 + 4/64 (0.5625) plain; about 0.5159 with double quant."""
    leaves = jax.tree.leaves(abstract(shape, double_quant, lead))
    return sum(x.size * x.dtype.itemsize for x in leaves) / math.prod(shape)
