"""The update of `--offload params` under Muon: on the device, a chunk of layers at a time.

Why not on the host, as AdamW's (`jdist.step.host_update`): Newton-Schulz is matmuls (at
8B, 83 TFLOPs a step per device on fsdp=8), which a host CPU would take minutes over, and
Muon lays each matrix out whole on the device that owns its layer by all-to-alls, which a
host computation cannot run (XLA CPU refuses a collective in one, jax 0.10.2). So the state
stays in host memory between steps and the walk brings in one chunk of layers at a time:
its gradients, moments and parameters come to the device, the optimizer's own update runs
on that slice of every tree (the same transform, so the same numbers as the whole-tree
update; AdamW's leaves of those layers, their norms, go the same way), and the new
parameters and moments go back into the host stacks. A chunk is as many layers as Muon's
owner layout spreads over the mesh (`muon.owner_axes`): each device orthogonalises one
layer's matrices whole per chunk, as it would without offload, and holds one layer's
matrices (gradient, momentum, update and the iteration's temporaries), not all of its own.
The shared parameters (embedding, final norm, head: AdamW) are one group, whole.
"""

from __future__ import annotations

import math

import jax
import optax
from jax import lax
from jax.tree_util import keystr, tree_flatten_with_path
from optax.contrib import MuonDimensionNumbers

from jdist.parallel.prefetch import to_device, to_host
from jdist.step import muon_cost
from jdist.step.layer_walk import clipped, nest
from jdist.step.moment_files import stacked_keys
from jdist.step.muon import owner_axes


def applies(plan) -> bool:
    """`--offload params` with Muon's state in the optimizer."""
    return plan.streams and bool(optax.tree_utils.tree_get_all_with_path(
        plan.abstract.opt_state, "MuonState"))


def device_bytes(plan) -> int:
    """Per device, what the walk holds of Muon's matrices at once (0 where it does not
    run): one chunk's share of the owned matrices whole (`muon_cost.update_bytes`, which
    counts all of a device's layers), that is one layer's per device."""
    if not applies(plan):
        return 0
    layers = max(stacked_keys(plan).values())
    owned = muon_cost.update_bytes(plan.abstract.opt_state, plan.opt_device_shardings,
                                   dict(plan.mesh.shape), plan.names)
    return owned * chunk(layers, dict(plan.mesh.shape)) // layers


def param_of(state_path, params: set):
    """The parameter key (of `params`) a state leaf belongs to, None for a scalar: the
    path's suffix that names a parameter (under Muon the state's first dict key is the
    partition's label, 'muon' or 'adamw', not the parameter's)."""
    return next((keystr(state_path[i:]) for i in range(len(state_path))
                 if keystr(state_path[i:]) in params), None)


def chunk(layers: int, mesh_shape: dict) -> int:
    """Layers per walk step: those Muon's owner layout puts one per device (or a divisor)."""
    axes = owner_axes((layers,), MuonDimensionNumbers((), ()), mesh_shape)[0] or ()
    return math.prod(mesh_shape[a] for a in axes)


def update_group(tx, members: dict, params: dict, grads: dict, moments: dict, counts: dict,
                 norm):
    """The optimizer `tx` (a `HostUpdate`) on one group: `members` (parameter key -> its
    path), their `params` and `grads` and the state's `moments` (state key -> array) as
    the device holds them, the state's scalars `counts`, gradients clipped by the global
    `norm`. -> (new params, new moments, new counts), keyed as given."""
    sub_p = nest({path: params[k] for k, path in members.items()})
    sub_g = nest({path: clipped(grads[k], norm, tx.clip_norm) for k, path in members.items()})
    given = {**moments, **counts}
    state = jax.tree_util.tree_map_with_path(lambda p, _: given[keystr(p)],
                                             jax.eval_shape(tx.init, sub_p))
    updates, state = tx.update(sub_g, state, sub_p)
    new_p = {keystr(p): x for p, x in tree_flatten_with_path(
        optax.apply_updates(sub_p, updates))[0]}
    new_s = {keystr(p): x for p, x in tree_flatten_with_path(state)[0]}
    return new_p, {k: new_s[k] for k in moments}, {k: new_s[k] for k in counts}


def update(plan, grads, opt_state, params, grad_norm):
    """(new parameters, new optimizer state), both in host memory as given: each run of
    stacked layers walked in chunks (a `lax.scan`), then the shared parameters."""
    flat = lambda tree: {keystr(p): x for p, x in tree_flatten_with_path(tree)[0]}
    p_all, g_all, s_all = flat(params), flat(grads), flat(opt_state)
    paths = {keystr(p): p for p, _ in tree_flatten_with_path(params)[0]}
    owner = {keystr(p): param_of(p, set(paths))
             for p, _ in tree_flatten_with_path(opt_state)[0]}
    counts = {k: to_device(x) for k, x in s_all.items() if owner[k] is None}
    stacked = stacked_keys(plan)
    for layers in sorted(set(stacked.values())):
        members = {k: paths[k] for k, n in stacked.items() if n == layers}
        size = chunk(layers, dict(plan.mesh.shape))
        state_keys = [k for k in s_all if owner[k] in members]

        def body(carry, c, members=members, size=size):
            p_run, s_run = carry
            take = lambda x: to_device(lax.dynamic_slice_in_dim(x, c * size, size, 0))
            put = lambda x, v: lax.dynamic_update_slice_in_dim(x, to_host(v), c * size, 0)
            new_p, new_s, _ = update_group(
                plan.tx, members, {k: take(p_run[k]) for k in members},
                {k: take(g_all[k]) for k in members}, {k: take(s_run[k]) for k in s_run},
                counts, grad_norm)
            return ({k: put(p_run[k], new_p[k]) for k in p_run},
                    {k: put(s_run[k], new_s[k]) for k in s_run}), None

        (p_run, s_run), _ = lax.scan(body, ({k: p_all[k] for k in members},
                                            {k: s_all[k] for k in state_keys}),
                                     jax.numpy.arange(layers // size))
        p_all.update(p_run)
        s_all.update(s_run)
    rest = {k: path for k, path in paths.items() if k not in stacked}
    rest_state = [k for k in s_all if owner[k] in rest]
    new_p, new_s, new_counts = update_group(
        plan.tx, rest, {k: to_device(p_all[k]) for k in rest},
        {k: to_device(g_all[k]) for k in rest}, {k: to_device(s_all[k]) for k in rest_state},
        counts, grad_norm)
    p_all.update({k: to_host(v) for k, v in new_p.items()})
    s_all.update({k: to_host(v) for k, v in {**new_s, **new_counts}.items()})
    unflat = lambda tree, values: jax.tree_util.tree_map_with_path(
        lambda p, _: values[keystr(p)], tree)
    return unflat(params, p_all), unflat(opt_state, s_all)
