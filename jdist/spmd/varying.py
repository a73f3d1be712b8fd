"""Which manual axes a value varies over inside a `jax.shard_map`, and making it vary.

Used by kernels and by model code alike (a loop carry that must vary as its updates do, an
operand that must vary before a custom VJP sees it), so it lives apart from both.
"""

from __future__ import annotations


def vma(x) -> tuple:
    """The manual axes `x` varies over (empty outside a shard_map). jax 0.10.2 spells it
    `aval.manual_axis_type.varying`; other releases `aval.vma`."""
    import jax

    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    found = kind.varying if kind is not None else getattr(aval, "vma", ())
    return tuple(sorted(found))


def varying(x, axes):
    """`x` typed as differing across `axes` (a loop carry, a local accumulator)."""
    import jax

    axes = tuple(a for a in axes if a not in vma(x))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def alike(*xs) -> tuple:
    """`xs`, each varying over every manual axis any of them does: operands a custom VJP
    receives this way get gradients of the same type, and autodiff, not the VJP, sums a
    gradient over an axis that one operand did not vary over (tensor: an expert's hidden
    units)."""
    axes = tuple(sorted({a for x in xs for a in vma(x)}))
    return tuple(varying(x, axes) for x in xs)


def zeros(shape, dtype, like):
    """Zeros that vary over the same manual axes as `like` (a loop carry made with plain
    `jnp.zeros` is invariant, and a scan then rejects the varying value it becomes)."""
    import jax.numpy as jnp

    return varying(jnp.zeros(shape, dtype), vma(like))
