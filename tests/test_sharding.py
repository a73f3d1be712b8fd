"""Parameters and optimizer state are born sharded, and no device holds what the rules split."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist.spmd.sharding import per_device_bytes
from jdist.step import init_state
from jdist.tools.equivalence import plan_of


def test_no_device_holds_a_full_copy_of_a_sharded_parameter():
    plan = plan_of("dp=2,fsdp=2,tp=2")
    state = init_state(plan, seed=0)
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    sharded = 0
    for path, array in flat:
        spec = array.sharding.spec
        for shard in array.addressable_shards:
            assert shard.data.shape == array.sharding.shard_shape(array.shape)
            if any(part is not None for part in spec):
                assert shard.data.shape != array.shape, jax.tree_util.keystr(path)
        sharded += any(part is not None for part in spec)
    assert sharded >= 9  # every matrix; only norm scales are replicated
    embed = state.params["embed"]
    assert embed.sharding.spec == P("tensor", "fsdp")
    assert embed.addressable_shards[0].data.shape == (128, 32)


def test_optimizer_state_is_sharded_like_its_parameter():
    plan = plan_of("fsdp=8")
    state = init_state(plan, seed=0)
    moments = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
               if hasattr(s, "mu")]  # adam's ScaleByAdamState, wherever the chain holds it
    assert len(moments) == 1
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(moments[0].mu)):
        assert m.sharding == p.sharding
    total = per_device_bytes(plan.abstract.opt_state, plan.shardings.opt_state)
    leaves = jax.tree.leaves(plan.abstract.opt_state)
    full = sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves)
    assert total < full / 4  # mostly 1/8, plus replicated norm scales and counters


def test_initialisation_does_not_depend_on_the_mesh():
    one, many = plan_of("dp=1"), plan_of("fsdp=2,tp=4")
    a = jax.tree.map(np.asarray, init_state(one, 3).params)
    b = jax.tree.map(np.asarray, init_state(many, 3).params)
    jax.tree.map(np.testing.assert_array_equal, a, b)
