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
