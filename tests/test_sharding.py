"""Parameters and optimizer state are born sharded, and no device holds what the rules split."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist.models import get_preset
from jdist.spmd.mesh import build_mesh
from jdist.spmd.rules import DEFAULT_RULES
from jdist.spmd.sharding import per_device_bytes
from jdist.step import init_state, make_optimizer, make_plan


def test_no_device_holds_a_full_copy_of_a_sharded_parameter():
    tx, _ = make_optimizer(1e-3, 10, 1)
    plan = make_plan(get_preset("tiny"), build_mesh("dp=2,fsdp=2,tp=2"), DEFAULT_RULES, tx)
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
    tx, _ = make_optimizer(1e-3, 10, 1)
    plan = make_plan(get_preset("tiny"), build_mesh("fsdp=8"), DEFAULT_RULES, tx)
    state = init_state(plan, seed=0)
    mu = state.opt_state[1][0].mu  # chain(clip, adamw(...)) -> adam's ScaleByAdamState
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(mu)):
        assert m.sharding == p.sharding
    total = per_device_bytes(plan.abstract.opt_state, plan.shardings.opt_state)
    leaves = jax.tree.leaves(plan.abstract.opt_state)
    full = sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves)
    assert total < full / 4  # mostly 1/8, plus replicated norm scales and counters


def test_initialisation_does_not_depend_on_the_mesh():
    tx, _ = make_optimizer(1e-3, 10, 1)
    model = get_preset("tiny")
    one = make_plan(model, build_mesh("dp=1", jax.devices()[:1]), DEFAULT_RULES, tx)
    many = make_plan(model, build_mesh("fsdp=2,tp=4"), DEFAULT_RULES, tx)
    a = jax.tree.map(np.asarray, init_state(one, 3).params)
    b = jax.tree.map(np.asarray, init_state(many, 3).params)
    jax.tree.map(np.testing.assert_array_equal, a, b)
