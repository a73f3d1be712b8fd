"""Explicit `jax.shard_map` kernels: the few computations GSPMD cannot shard well by itself.

Attention: `flash` (blockwise, O(S) memory; its arithmetic in `blockwise`) and `attention`
(which implementation a step runs: xla, flash, cudnn). Context parallelism over `sequence`:
`context` chooses the strategy; `ring_attention`, `all_gather_attention` and
`ulysses_attention` run flash blocks; `load_balance` reorders tokens so causal work is even.
The vocabulary: `vocab` (chunked, vocab-parallel cross-entropy), `embedding` (the lookup of
a table that stays sharded). Parameters and gradients: `grad_sync`. Experts: `moe`.
Pipelines: `pipeline`, `schedule`, `stage_program`, `layer_shuffle`.
"""

# `check_vma` of the kernels' shard_maps: JAX tracks which manual axes each value varies
# over, so a missing or doubled reduction is a trace-time error rather than a wrong number.
# (The step's replica shard_map around them is the one exception: jdist.parallel.grad_sync.)
CHECK_VMA = True


def manual_axes() -> set[str]:
    """Mesh axes made manual by the shard_maps being traced around this point."""
    import jax

    context = jax.sharding.get_abstract_mesh()
    return set() if context.empty else {  # axis_types: public on jax 0.10 and 0.11
        name for name, kind in zip(context.axis_names, context.axis_types)
        if kind == jax.sharding.AxisType.Manual}


def kernel_mesh(mesh) -> dict:
    """`mesh=` and `axis_names=` for a kernel's `shard_map`: the whole mesh, or, nested
    inside another shard_map (the step's is manual over the replica axes, a pipeline
    stage's over `stage` too), the current abstract mesh and only the axes that one left
    automatic."""
    import jax

    manual = manual_axes()
    context = jax.sharding.get_abstract_mesh()
    if not manual:
        return {"mesh": mesh, "axis_names": frozenset(mesh.axis_names)}
    return {"mesh": context, "axis_names": frozenset(a for a in mesh.axis_names
                                                     if a not in manual)}
