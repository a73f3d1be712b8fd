"""Explicit `jax.shard_map` kernels: the few computations GSPMD cannot shard well by itself.

Context parallelism over `sequence`: `context` chooses the attention strategy of a training
step; `ring_attention`, `all_gather_attention` and `ulysses_attention` are the strategies;
`blockwise` holds the attention arithmetic they share; `load_balance` reorders tokens so
causal work is even.
"""

# `check_vma` of every kernel's shard_map. Off: the training step runs the kernels under
# `vmap(spmd_axis_name=data)` (jdist.train.grads), which makes `data` a manual axis that the
# kernels' own values (axis_index, masks) do not vary over, and jax 0.10 then rejects the
# mixed operations. The kernels communicate only with ppermute, all_gather and all_to_all,
# whose transposes do not depend on the check, and the ring has its own VJP.
CHECK_VMA = False


def kernel_mesh(mesh) -> dict:
    """`mesh=` and `axis_names=` for a kernel's `shard_map`: the whole mesh, or, nested
    inside another shard_map (a pipeline stage is manual over `stage` and `data`), the
    current abstract mesh and only the axes that one left automatic."""
    import jax

    context = jax.sharding.get_abstract_mesh()
    manual = set() if context.empty else {  # axis_types: public on jax 0.10 and 0.11
        name for name, kind in zip(context.axis_names, context.axis_types)
        if kind == jax.sharding.AxisType.Manual}
    if not manual:
        return {"mesh": mesh, "axis_names": frozenset(mesh.axis_names)}
    return {"mesh": context, "axis_names": frozenset(a for a in mesh.axis_names
                                                     if a not in manual)}
