"""`--optimizer muon` and `--schedule wsd`: Muon's updates equal one device's on every
layout (the orthogonalisation of a sharded matrix included), its Newton-Schulz iteration
orthogonalises, and the warmup-stable-decay schedule follows its definition."""

import jax
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers

from jdist.models import get_preset
from jdist.step.muon import NS_COEFFS, NS_STEPS, dimension_numbers
from jdist.step.optim import lr_schedule
from jdist.tools.equivalence import assert_matches, config, plan_of, train_steps

TINY, MOE = get_preset("tiny"), get_preset("moe-tiny")
TINY4 = get_preset("tiny", n_layers=4)  # two layers per stage at pp=2


def test_newton_schulz_singular_values_lie_in_the_quintic_band():
    """A property of the output, not a recomputation: the quintic (3.4445, -4.7750, 2.0315)
    does not converge to 1 but maps every singular value not too small for 5 steps (a
    rectangular Gaussian's, spread over up to 2 decades: measured 0.68 to 1.20) into about
    [0.7, 1.2]."""
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    for shape, decades in [((64, 128), 0), ((96, 32), 1), ((32, 96), 2)]:
        g = jax.random.normal(jax.random.key(0), shape)
        g = g * jax.numpy.logspace(-decades, 0, shape[1])
        o = orthogonalize_via_newton_schulz(g, jax.numpy.asarray(NS_COEFFS), NS_STEPS)
        s = np.linalg.svd(np.asarray(o), compute_uv=False)
        assert 0.65 < s.min() and s.max() < 1.25, (shape, s.min(), s.max())
        before = np.linalg.svd(np.asarray(g), compute_uv=False)
        assert before.max() / before.min() > 2 * s.max() / s.min()  # it did equalise


def test_matrices_and_their_axes_come_from_the_logical_names():
    assert dimension_numbers(("layers", "embed", "heads", "head_dim")) == \
        MuonDimensionNumbers((1,), (2, 3))  # wq: embed in, heads x head_dim out
    assert dimension_numbers(("layers", "heads", "head_dim", "embed")) == \
        MuonDimensionNumbers((1, 2), (3,))  # wo
    assert dimension_numbers(("layers", "experts", "mlp", "embed")) == \
        MuonDimensionNumbers((2,), (3,))  # one matrix per layer and expert
    for adamw in [("vocab", "embed"), ("embed", "vocab"), ("layers", "norm"),
                  ("layers", "embed", None), ("layers", "embed", "lora_rank")]:
        assert dimension_numbers(adamw) is None, adamw


def test_wsd_schedule_follows_its_definition():
    lr, steps, warmup = 1.0, 100, 10
    wsd = lr_schedule(lr, steps, warmup, kind="wsd", decay_fraction=0.2)
    at = lambda count: float(wsd(count))
    assert at(0) == pytest.approx(lr / warmup)          # step 1
    assert at(warmup - 1) == pytest.approx(lr)           # step `warmup`: the peak
    assert {at(c) for c in range(warmup - 1, 80)} == {lr}  # stable to step 80
    assert at(80) < lr                                   # steps 81-100 decay
    assert at(89) == pytest.approx(0.1 + 0.9 * (1 - np.sqrt(0.5)))  # 1-sqrt, halfway
    assert at(steps - 1) == pytest.approx(0.1)          # the last step at the floor
    cosine = lr_schedule(lr, steps, warmup)
    assert [at(c) for c in range(warmup)] == [float(cosine(c)) for c in range(warmup)]


@pytest.fixture(scope="module")
def reference(single_device):
    return single_device(TINY, optimizer="muon")


# ZeRO-0 on dp=2,fsdp=2,tp=2 went for the suite's time: ZeRO 1 and 3 on that mesh and 2 on
# dp=4,tp=2 stay (and Muon at ZeRO 1 under --offload params in test_offload).
@pytest.mark.parametrize("mesh, zero, offload", [
    ("dp=2,fsdp=2,tp=2", 3, "none"),
    ("dp=2,fsdp=2,tp=2", 1, "optimizer"), ("dp=4,tp=2", 2, "none")])
def test_muon_matches_single_device(corpus, reference, mesh, zero, offload):
    run = train_steps(TINY, mesh, corpus.train,
                      config(optimizer="muon", zero=zero, offload=offload))
    assert_matches(run, reference)


def test_muon_moves_the_weights_differently_from_adamw(corpus, reference, single_device):
    """Guards the tests above against an optimizer flag the harness ignores."""
    assert not np.allclose(reference.losses[1:], single_device(TINY).losses[1:], rtol=1e-4)


@pytest.mark.slow
def test_muon_per_expert_matches_single_device(corpus, single_device):
    assert_matches(train_steps(MOE, "fsdp=2,ep=2", corpus.train, config(optimizer="muon")),
                   single_device(MOE, optimizer="muon"))


# Muon pipelined (pp=2,fsdp=2, 1f1b, --prefetch on): test_offload_disk's
# test_muon_on_disk_matches_single_device[pp2], the same layout with its state on disk.


def test_muon_keeps_one_moment_per_matrix():
    """The memory model reads the optimizer state's shapes: Muon's is AdamW's less one
    float32 moment of every projection matrix (a few scalars aside)."""
    from jdist.memory import state_bytes
    from jdist.step.muon_cost import update_bytes

    adamw, muon = plan_of("fsdp=2"), plan_of("fsdp=2", optimizer="muon")
    projections = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    matrices = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(adamw.abstract.params)
                   if path[-1].key in projections)
    saved = state_bytes(adamw)[2] - state_bytes(muon)[2]
    assert 0 <= 4 * matrices // 2 - saved < 64, (saved, 4 * matrices // 2)  # fsdp=2 halves
    # The update's temporaries: gradient, momentum and update of each device's layer, whole.
    update = [update_bytes(p.abstract.opt_state, p.opt_device_shardings, dict(p.mesh.shape),
                           p.names) for p in (adamw, muon)]
    assert update == [0, 3 * 4 * matrices // 2]


@pytest.mark.parametrize("fraction", ["0", "1.5", "nan"])
def test_a_decay_fraction_outside_0_1_is_refused_in_one_line(fraction):
    from jdist.config import parse_args
    from jdist.errors import ConfigError
    from jdist.step.from_flags import plan_for

    with pytest.raises(ConfigError, match=f"--decay-fraction {float(fraction)} must be above "
                                          "0 and at most 1"):
        plan_for(parse_args(["--model", "tiny", "--schedule", "wsd",
                             "--decay-fraction", fraction]))


def test_owners_take_the_mesh_axes_that_divide_layers_then_experts():
    from jdist.step.muon import owner_axes

    wq, expert = MuonDimensionNumbers((1,), (2, 3)), MuonDimensionNumbers((2,), (3,))
    mesh = {"data": 2, "stage": 1, "fsdp": 4, "expert": 2, "tensor": 2}
    assert owner_axes((32, 64, 8, 8), wq, mesh) == [("data", "fsdp", "expert", "tensor"),
                                                    None, None, None]
    assert owner_axes((8, 4, 64, 64), expert, mesh) == [("data", "fsdp"), ("expert", "tensor"),
                                                        None, None]
    assert owner_axes((2, 64, 8, 8), wq, {"fsdp": 8}) == [None] * 4  # XLA's way then


def test_owned_matrices_cost_all_to_alls_not_gathers():
    """What the owner layout is for: on fsdp=2 Muon adds no all-gather or all-reduce to
    AdamW's step (XLA's own partitioning of the iteration adds ~10x the momentum's bytes
    of all-gathers, docs/muon.md), only all-to-alls."""
    from jdist.plan.traffic import step_traffic
    from jdist.step import make_train_step
    from jdist.tools.hlo import executed_collective_bytes

    tokens = jax.ShapeDtypeStruct((8, 32), np.int32)
    moved = {}
    for optimizer in ("adamw", "muon"):
        plan = plan_of("fsdp=2", optimizer=optimizer, batch_size=8, seq_len=32)
        lowered = make_train_step(plan).lower(plan.abstract, {"inputs": tokens,
                                                             "targets": tokens})
        moved[optimizer] = executed_collective_bytes(lowered.compile().as_text())
    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        assert moved["muon"][kind] == moved["adamw"][kind], (kind, moved)
    # The planner's traffic model predicts the all-to-alls (fitted: 6x the owned matrices).
    predicted = {p: sum(r.bytes for r in step_traffic(plan_of("fsdp=2", optimizer=p,
                                                                batch_size=8, seq_len=32),
                                                        8, 32) if r.kind == "all-to-all")
                 for p in moved}
    assert predicted == {p: moved[p]["all-to-all"] for p in moved}, (predicted, moved)
