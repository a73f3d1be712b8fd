"""What the compiler actually emits: collectives read off the compiled step's HLO."""

import jax
import jax.numpy as jnp
import pytest

from jdist.parallel import embedding
from jdist.step import make_eval_step, make_train_step
from jdist.tools.equivalence import plan_of
from jdist.tools.hlo import collective_counts, collective_shapes, loop_bodies, partitioned

TOKENS = jax.ShapeDtypeStruct((16, 32), jnp.int32)
BATCH = {"inputs": TOKENS, "targets": TOKENS}


def train_step_hlo(plan) -> str:
    # lowered on abstract inputs: nothing is allocated
    return make_train_step(plan).lower(plan.abstract, BATCH).compile().as_text()


def forward_hlo(plan) -> str:
    return make_eval_step(plan).lower(plan.abstract.params, BATCH).compile().as_text()


def test_ddp_all_reduces_gradients_and_never_gathers_parameters():
    counts = collective_counts(train_step_hlo(plan_of("dp=8")))
    assert counts["all-reduce"] >= 1
    assert counts["all-gather"] == 0


@pytest.mark.parametrize("mesh", ["fsdp=8", "dp=2,fsdp=4"])
def test_fsdp_all_gathers_parameters(mesh):
    text = train_step_hlo(plan_of(mesh))
    assert collective_counts(text)["all-gather"] >= 1
    # ... inside the layer loop, i.e. just in time for each block, not once up front.
    assert any(collective_counts(body)["all-gather"] >= 1 for body in loop_bodies(text))


def test_tensor_parallel_block_has_two_all_reduces_per_forward():
    # Megatron: row-parallel attention output and MLP down projections each end in one
    # all-reduce over `tensor`; nothing else in a block communicates.
    (tp_body,) = loop_bodies(forward_hlo(plan_of("dp=2,tp=4")))
    assert collective_counts(tp_body)["all-reduce"] == 2
    (dp_body,) = loop_bodies(forward_hlo(plan_of("dp=8")))
    assert collective_counts(dp_body)["all-reduce"] == 0


@pytest.mark.parametrize("mesh", ["fsdp=8", "tp=4", "dp=2,fsdp=2,tp=2"])
def test_embedding_table_is_never_gathered(mesh, monkeypatch):
    # The table [512, 64] stays sharded (vocab over tensor, embed over fsdp): tokens and
    # rows move instead. The old path (the table gathered for a local take) is caught.
    plan = plan_of(mesh, vocab_size=512)

    def table_gathers() -> list:
        text = partitioned(make_train_step(plan).lower(plan.abstract, BATCH))
        return [s for s in collective_shapes(text, "all-gather") if s[:1] == (512,)]

    assert table_gathers() == []
    if mesh == "fsdp=8":  # the check sees the old path: the whole table gathered
        monkeypatch.setattr(embedding, "supports", lambda sync: False)
        assert table_gathers()
