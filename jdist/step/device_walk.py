"""The update of `--offload params` under Muon: on the device, a chunk of layers at a time.

Why not on the host, as AdamW's (`jdist.step.host_update`): Newton-Schulz is matmuls (at
8B, 83 TFLOPs a step per device on fsdp=8), which a host CPU would take minutes over, and
Muon lays each matrix out whole on the device that owns its layer by all-to-alls, which a
host computation cannot run (XLA CPU refuses a collective in one, jax 0.10.2). So the state
stays in host memory between steps and the walk brings in one chunk of layers at a time:
its gradients, moments and parameters come to the device, the optimizer's own update runs
on that slice of every tree (the same transform, so the same numbers as the whole-tree
update; AdamW's leaves of those layers, their norms, go the same way), and the new
parameters and moments go back into the host stacks. The chunks are `--offload disk`'s
groups (`jdist.step.layer_walk.stacks`): as many layers as Muon's owner layout spreads over
the mesh (times the pp stages), so each device orthogonalises one layer's matrices whole per
chunk, as it would without offload, and holds one layer's matrices (gradient, momentum,
update and the iteration's temporaries), not all of its own.
The shared parameters (embedding, final norm, head: AdamW) are one group, whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.tree_util import keystr, tree_flatten_with_path

from jdist.parallel.prefetch import to_device, to_host
from jdist.step import muon_cost
from jdist.step.layer_walk import group_update, put, stacks, take
from jdist.step.moment_files import param_key


def applies(plan) -> bool:
    """`--offload params` with Muon's state in the optimizer."""
    return plan.streams and bool(optax.tree_utils.tree_get_all_with_path(
        plan.abstract.opt_state, "MuonState"))


def device_bytes(plan) -> int:
    """Per device, what the walk holds of Muon's matrices at once (0 where it does not
    run): one group's share of the owned matrices whole (`muon_cost.update_bytes` counts
    all of a device's layers; the walk takes them in `groups` steps), about one layer's."""
    if not applies(plan):
        return 0
    groups = max(n for _, n in stacks(plan).values())
    owned = muon_cost.update_bytes(plan.abstract.opt_state, plan.opt_device_shardings,
                                   dict(plan.mesh.shape), plan.names)
    return owned // groups


def update(plan, grads, opt_state, params, grad_norm):
    """(new parameters, new optimizer state), both in host memory as given: each run of
    stacked layers walked a chunk at a time (a `lax.scan` of `layer_walk.group_update`),
    then the shared parameters as one group."""
    tx, stacked = plan.tx, stacks(plan)
    moments = {keystr(p): x for p, x in tree_flatten_with_path(opt_state)[0]}
    owner = {keystr(p): param_key(p) for p, _ in tree_flatten_with_path(opt_state)[0]}
    counts = {k: to_device(x) for k, x in moments.items() if owner[k] is None}
    for chunks in sorted({n for _, n in stacked.values()}):
        members = tuple(k for k, (_, n) in stacked.items() if n == chunks)
        mine = {k: x for k, x in moments.items() if owner[k] in members}

        def body(carry, j, members=members):
            params, mine = carry
            split = lambda k: stacked[owner[k]][0]
            state = {k: to_device(take(x, split(k), j)) for k, x in mine.items()}
            params, new = group_update(tx, params, grads, {**state, **counts}, grad_norm,
                                       members, j, stacked, to_device, to_host)
            return (params, {k: put(x, split(k), j, to_host(new[k]))
                             for k, x in mine.items()}), None

        (params, mine), _ = lax.scan(body, (params, mine), jnp.arange(chunks))
        moments.update(mine)
    rest = tuple(keystr(p) for p, _ in tree_flatten_with_path(params)[0]
                 if keystr(p) not in stacked)
    state = {k: to_device(x) for k, x in moments.items() if owner[k] in rest}
    params, new = group_update(tx, params, grads, {**state, **counts}, grad_norm, rest, None,
                               stacked, to_device, to_host)
    moments.update({k: to_host(x) for k, x in new.items()})
    return params, jax.tree_util.tree_map_with_path(lambda p, _: moments[keystr(p)],
                                                    opt_state)
