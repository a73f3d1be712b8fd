"""The optimizer update of `--offload params`, on host-resident state: the gradients (written
back to the host layer by layer, `jdist.parallel.prefetch.run`), the optimizer state and the
float32 parameters never come to the device whole; the update runs where they are, under
`compute_on("device_host")`.

What each compiler accepts (jax 0.10.2): XLA CPU compiles the elementwise update as a host
computation, but not a collective inside one (the global norm of sharded gradients: "memory
space of all inputs must be the same"), so the norm is taken by the step's device program
and only the clip factor enters the host computation (`jdist.step.optim.HostUpdate`). The
H100 GPU compiler deviceless has no host memory space at all (compile-only devices list no
memories; a pinned_host sharding compiles as device memory), so `--offload params` is
refused with `--target` (`jdist.step.from_flags`).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import optax
from jax.experimental.compute_on import compute_on

from jdist.parallel.prefetch import to_device, to_host


def clip_factor(norm, clip_norm: float):
    """What `optax.clip_by_global_norm` multiplies every gradient by, given the norm it
    would compute (it cannot be handed one)."""
    return jnp.where(norm < clip_norm, 1.0, clip_norm / norm)


def norm(grads) -> jax.Array:
    """The global norm of host-resident gradients, on the device: each leaf read back for
    its sum of squares (a host computation cannot take a global norm)."""
    return optax.tree.norm(jax.tree.map(to_device, grads))


def update(tx, grads, opt_state, params, grad_norm):
    """(new parameters, new optimizer state) of a `HostUpdate` `tx`, on the host, the
    gradients clipped by their global norm `grad_norm` (`norm`)."""
    factor = to_host(clip_factor(grad_norm, tx.clip_norm))
    grads = jax.tree.map(to_host, grads)  # the shared parameters' are on the device

    def step(grads, factor, opt_state, params):
        clipped = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
        updates, opt_state = tx.update(clipped, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return on_host(jax.jit(step))(grads, factor, opt_state, params)


def on_host(fn):
    """`fn` as a host computation whose outputs stay in host memory. jax 0.12 asks for the
    outputs' memory spaces; jax 0.10.2's `compute_on` takes the compute type alone."""
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:  # jax 0.12
        return compute_on(fn, compute_type="device_host",
                          out_memory_spaces=jax.memory.Space.Host)
    return compute_on("device_host")(fn)
