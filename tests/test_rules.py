import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist.errors import ConfigError
from jdist.spmd import axes as ax
from jdist.spmd.mesh import build_mesh
from jdist.spmd.rules import (
    DEFAULT_RULES,
    constrainer,
    load_rules,
    override,
    resolve,
    with_sequence_parallel,
)


def test_first_unused_candidate_wins():
    rules = (("a", "tensor"), ("b", "tensor"), ("b", "fsdp"))
    assert resolve(("a", "b"), rules) == P("tensor", "fsdp")
    assert resolve(("b", "a"), rules) == P("fsdp", "tensor")  # rule order, not dim order


def test_unknown_names_are_replicated():
    assert resolve(("nope", ax.EMBED, None), DEFAULT_RULES) == P(None, "fsdp", None)


def test_multi_axis_candidate_and_trivial_axes_dropped():
    mesh = build_mesh("dp=8")
    assert resolve((ax.BATCH, ax.LENGTH), DEFAULT_RULES) == P(("data", "fsdp", "expert"),
                                                              "sequence")
    assert resolve((ax.BATCH, ax.LENGTH), DEFAULT_RULES, mesh) == P("data", None)


def test_sequence_parallel_shards_residual_length_but_not_attention():
    rules = with_sequence_parallel(DEFAULT_RULES)
    mesh = build_mesh("fsdp=2,tp=4")
    assert resolve((ax.BATCH, ax.LENGTH, ax.ACT_EMBED), rules, mesh) == P("fsdp", "tensor", None)
    assert resolve((ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM), rules, mesh) == \
        P("fsdp", None, "tensor", None)


def test_override_from_python_and_toml(tmp_path):
    rules = override(DEFAULT_RULES, {ax.EMBED: ["tp"], ax.MLP: []})
    assert resolve((ax.EMBED, ax.MLP), rules) == P("tensor", None)
    path = tmp_path / "rules.toml"
    path.write_text('[rules]\nembed = ["tensor"]\nbatch = [["data", "fsdp"], "data"]\n')
    rules = load_rules(path)
    assert resolve((ax.EMBED,), rules) == P("tensor")
    assert resolve((ax.BATCH,), rules) == P(("data", "fsdp"))


@pytest.mark.parametrize("text, fragment", [
    ('[rules]\nembed = ["gpu"]\n', "unknown mesh axis 'gpu'"),
    ("[rules\n", "not valid TOML"),
    ('embed = ["tensor"]\n', "no \\[rules\\] table"),
    ('[rules]\nembed = "tensor"\n', "must be a list"),
])
def test_bad_rules_files(tmp_path, text, fragment):
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_rules(path)


def test_constrainer_shards_activations_by_their_logical_names():
    import jax.numpy as jnp

    x = jnp.ones((8, 4, 2))
    mesh = build_mesh("dp=8")
    constrain = constrainer(mesh, DEFAULT_RULES)

    @jax.jit
    def f(x):
        return constrain(x * 2, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))

    assert f(x).sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3)


def test_a_rule_that_puts_a_replica_axis_second_is_refused_before_compiling():
    """The step is manual over data and fsdp, which must lead a dimension's sharding."""
    from jdist.models import get_preset
    from jdist.step import make_optimizer, make_plan

    rules = override(DEFAULT_RULES, {"mlp": [], "embed": [["tensor", "fsdp"]]})
    tx, _ = make_optimizer(1e-3, 10, 1)
    with pytest.raises(ConfigError, match="puts fsdp after another mesh axis"):
        make_plan(get_preset("tiny"), build_mesh("fsdp=2,tp=2", jax.devices()[:4]), rules, tx)
