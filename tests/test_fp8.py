"""FP8 projections (jdist.quant.fp8): the quantization itself, and mesh invariance of a training
run with `--fp8` against the one-device FP8 run (same seed and batches, float32 compute)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.models import get_preset
from jdist.quant import fp8
from jdist.spmd.rules import DEFAULT_RULES, with_sequence_parallel
from jdist.tools.equivalence import assert_matches, config, train_steps

TINY = get_preset("tiny")


def test_scales_are_the_powers_of_two_that_fit_the_largest_value():
    x = jnp.array([[3.0, -1000.0, 0.5], [1e-3, 2e-3, 0.0], [0.0, 0.0, 0.0]])
    for dtype in (fp8.E4M3, fp8.E5M2):
        top = float(jnp.finfo(dtype).max)
        s = fp8.scale_of(x, dtype, (1,))
        assert s.shape == (3, 1)
        exponent = np.log2(np.asarray(s))
        assert np.all(exponent == np.round(exponent))  # rescaling is exact
        amax = np.abs(np.asarray(x)).max(axis=1, keepdims=True)[:2]
        # The largest value lands in the top binade of the format: it fits, and half the
        # scale would not.
        assert np.all(amax / s[:2] <= top) and np.all(amax / s[:2] > top / 2)
        assert s[2, 0] == 1.0  # an all-zero row
        assert fp8.scale_of(x, dtype, (0, 1)).shape == (1, 1)


@pytest.mark.parametrize("mode", fp8.MODES)
def test_projection_rounds_to_fp8_in_all_three_matmuls(mode):
    """Forward, input gradient and weight gradient each differ from the float32 einsum by
    about the format's rounding (e4m3: 3 mantissa bits, e5m2: 2), not by more and not by
    nothing: each matmul quantizes."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (2, 16, 32))
    w = jax.random.normal(keys[1], (32, 4, 8)) * 0.05
    g = jax.random.normal(keys[2], (2, 16, 4, 8))
    eq = "bse,ehd->bshd"
    y, pull = jax.vjp(lambda x, w: fp8.project(eq, mode, (), x, w), x, w)
    want, pull_ref = jax.vjp(lambda x, w: jnp.einsum(eq, x, w, precision="highest"), x, w)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    errors = [rel(y, want), *(rel(a, b) for a, b in zip(pull(g), pull_ref(g)))]
    assert 0.01 < errors[0] < 0.06, errors       # e4m3 x e4m3
    assert all(0.02 < e < 0.1 for e in errors[1:]), errors  # e5m2 cotangent


def test_rowwise_keeps_a_small_row_that_tensorwise_flushes():
    """Rows of very different magnitude: one scale per tensor sends the small row below
    e4m3's smallest subnormal; rowwise scales keep it."""
    x = jnp.stack([jnp.full((8,), 1e4), jnp.linspace(1e-4, 2e-4, 8)])[None]  # [1, 2, 8]
    w = jnp.eye(8)
    got = {m: fp8.project("bse,ef->bsf", m, (), x, w) for m in fp8.MODES}
    small = lambda y: float(jnp.abs(y[0, 1] - x[0, 1]).max() / x[0, 1].max())
    assert small(got["rowwise"]) < 0.07 and small(got["tensorwise"]) > 0.5


@pytest.mark.parametrize("mode", fp8.MODES)
def test_scales_of_a_split_batch_are_the_whole_batchs(mode):
    """Inside the step's shard_map the batch is split over manual axes: a scale reduced over
    the batch (tensorwise; rowwise, the weight gradient's over tokens) takes the max over
    the shards, so each shard quantizes as one device would. Two rows five decades apart,
    the large one's cotangent zero: the weight gradient of the large row's features is the
    small row's alone, which its own scale would keep and the whole batch's rounds away."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (2, 4, 16)) * jnp.array([1e3, 1e-2])[:, None, None]
    x = x.at[0, :, 8:].set(0.0)
    w = jax.random.normal(keys[1], (16, 8)) * 0.1
    g = jax.random.normal(keys[2], (2, 4, 8)).at[0].set(0.0)
    eq = "bse,ef->bsf"

    def grads(manual):
        def local(x, w, g):
            y, pull = jax.vjp(lambda x, w: fp8.project(eq, mode, manual, x, w), x, w)
            dx, dw = pull(g)
            return y, dx, jax.lax.psum(dw, "data")
        split, whole = jax.sharding.PartitionSpec("data"), jax.sharding.PartitionSpec()
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(split, whole, split),
                                     out_specs=(split, split, whole),
                                     check_vma=False))(x, w, g)  # as the step's

    y, pull = jax.vjp(lambda x, w: fp8.project(eq, mode, (), x, w), x, w)
    one_device = (y, *pull(g))
    for got, want in zip(grads((("b", ("data",)),)), one_device):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    # Per-shard scales would not be the one device's: what the pmax is for.
    _, _, dw_alone = grads(())
    assert not np.allclose(dw_alone[:8], one_device[2][:8], rtol=0.1, atol=0)


# FP8's rounding is a step function, so a float32 summation-order difference between meshes
# (1e-7: tensor parallelism's partial sums, the vocab-parallel head's backward) flips the
# code of an element now and then, by a whole e4m3/e5m2 step (6-12%). Measured in float32
# (tiny, jax 0.10.2): about one flip a step, e.g. one e5m2 element of layer 0's key
# cotangent under tp=2, which moves one column of wk's gradient by 1.8e-5; through AdamW,
# 3e-4 in the third step's gradient norm. Those are the meshes' float32 noise, not their
# quantization. In float64 activations the same summation orders move values by 1e-16 and
# no code flips, so the runs below prove the quantization mesh-invariant to float32's 1e-5
# (the float32 master weights' reductions): every step, every gradient leaf.
F64 = {"compute_dtype": "float64"}


def fp8_dots(run) -> tuple[int, int]:
    """(dots on e4m3 operands only, dots with an e5m2 operand) in the run's lowered step."""
    dots = [line for line in run.lowered.as_text().splitlines() if "dot_general" in line]
    return (sum("f8E4M3FN" in line and "f8E5M2" not in line for line in dots),
            sum("f8E5M2" in line for line in dots))


def assert_fp8(run, reference, expected: tuple[int, int]) -> None:
    """FP8 is on: the one-device step has the `expected` float8 dots (per layer loop: the
    forward's, and those of the e5m2 cotangent), the run's step some of each."""
    assert fp8_dots(reference) == expected
    assert all(n > 0 for n in fp8_dots(run))


DENSE_DOTS = (7, 14)  # q, k, v, o, gate, up, down: forward; input and weight gradients


# (dp=2,fsdp=2,tp=2 with ZeRO-3: test_fp8_lora_base_matches_one_device's layout.)
@pytest.mark.parametrize("mesh, mode, flags, sequence_parallel", [
    ("fsdp=2,tp=4", "tensorwise", {"remat": "selective"}, True),
    ("dp=2,sp=2,tp=2", "rowwise", {"cp_strategy": "ring"}, False),
])
def test_fp8_run_matches_one_device(corpus, single_device, mesh, mode, flags,
                                    sequence_parallel):
    """Scales from the whole tensor's amax (pmax over the replica axes, the partitioner's
    max over tensor and sequence shards): on every mesh the operands quantize alike."""
    rules = with_sequence_parallel(DEFAULT_RULES) if sequence_parallel else DEFAULT_RULES
    with jax.enable_x64(True):
        run = train_steps(TINY, mesh, corpus.train, config(fp8=mode, **F64, **flags),
                          rules=rules)
        reference = single_device(TINY, fp8=mode, **F64)
        assert_matches(run, reference)
        assert_fp8(run, reference, DENSE_DOTS)


def test_fp8_experts_match_one_device(corpus, single_device):
    """Expert matmuls in FP8: the grouped path on expert and tensor shards (tokens in
    rounds, hidden units split) against the padded dropless path on one device. Each row
    and each expert has its own scales (tensorwise: per expert), so where a row lands
    cannot change its quantization; the hidden dimension's amaxes are combined over tensor."""
    moe = get_preset("moe-tiny")
    with jax.enable_x64(True):
        run = train_steps(dataclasses.replace(moe, moe_routing="grouped"), "fsdp=2,ep=2,tp=2",
                          corpus.train, config(fp8="tensorwise", **F64))
        reference = single_device(moe, fp8="tensorwise", **F64)
        assert_matches(run, reference)
        # attention's 4 and the experts' 3 forward; the experts' weight gradient is not
        # FP8: 4 x 2 + 3 with e5m2.
        assert_fp8(run, reference, (7, 11))


def test_fp8_lora_base_matches_one_device(corpus, single_device):
    """LoRA on an FP8 base: the frozen base's projections in FP8 (no weight gradient), the
    adapters in the compute dtype. Step 2's gradients, the first where A's is nonzero. On
    dp x fsdp x tp under ZeRO-3 (once a case of its own without LoRA: the forward's and the
    input gradients' scales reduced over the replica axes as here)."""
    from jdist.models.lora import LoraConfig

    lora = dataclasses.replace(TINY, lora=LoraConfig(4, 8.0))
    flags = {"fp8": "rowwise", "lr": 1e-2, "zero": 3, **F64}
    with jax.enable_x64(True):
        run = train_steps(lora, "dp=2,fsdp=2,tp=2", corpus.train, config(**flags), grads_step=2)
        reference = single_device(lora, **flags, grads_step=2)
        assert_matches(run, reference)
        assert_fp8(run, reference, (7, 7))  # the frozen base's weight gradients never run


def test_expert_scales_are_per_expert_and_per_row():
    """Two experts five decades apart: one scale over both (tensorwise over the stacked
    weights) would flush the small expert below e4m3's range; each expert's own keeps it,
    and the input gradient quantizes per row too."""
    keys = jax.random.split(jax.random.key(2), 3)
    w = jax.random.normal(keys[0], (2, 16, 8)) * jnp.array([1e2, 1e-3])[:, None, None]
    h = jax.random.normal(keys[1], (2, 4, 16))
    g = jax.random.normal(keys[2], (2, 4, 8)) * jnp.array([1.0, 1.0, 1e-10, 1e-10])[:, None]
    dot = fp8.expert_dots("tensorwise", ()).padded
    eq = "ecd,edf->ecf"
    y, pull = jax.vjp(lambda h, w: dot.project(eq, h, w), h, w)
    want, pull_ref = jax.vjp(lambda h, w: jnp.einsum(eq, h, w, precision="highest"), h, w)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    for e in range(2):
        assert rel(y[e], want[e]) < 0.06  # the small expert too
    dh, dh_ref = pull(g)[0], pull_ref(g)[0]
    assert rel(dh[:, 2:], dh_ref[:, 2:]) < 0.1  # the small rows of the cotangent
    flushed = fp8.scaled_einsum(eq, h, fp8.E4M3, w, fp8.E4M3, "tensorwise", {})
    assert rel(flushed[1], want[1]) > 0.5
    flushed = fp8.scaled_einsum("ecf,edf->ecd", g, fp8.E5M2, w, fp8.E4M3, "tensorwise", {},
                                keep="e")  # per expert, not per row
    assert rel(flushed[:, 2:], dh_ref[:, 2:]) > 0.5


def test_fp8_pipeline_matches_one_device(corpus, single_device):
    """Pipeline stages quantize per micro-batch, their amaxes reduced over `data` inside the
    tick's switch; zb-h1's split backward quantizes in both halves. Against the one-device
    FP8 run, whose scales are the whole batch's: powers of two, so a scale changes a
    rounding only at the format's range edges, and without tensor parallelism's summation
    order the run agrees at float32's 1e-5 (5e-7 observed, jax 0.10.2)."""
    from jdist.parallel.pipeline import PipelineConfig

    run = train_steps(TINY, "dp=2,pp=2", corpus.train, config(fp8="rowwise"),
                      pipeline=PipelineConfig("zb-h1", 4))
    reference = single_device(TINY, fp8="rowwise")
    assert_matches(run, reference)
    assert_fp8(run, reference, DENSE_DOTS)  # in the stages too


@pytest.mark.parametrize("args, message", [
    (["--compute-dtype", "float64"], "--compute-dtype float64 needs 64-bit JAX: set "
                                     "JAX_ENABLE_X64=1"),
    (["--tp-halves"], "--fp8 scales over all of a micro-batch's tokens, --tp-halves splits "
                      "them; drop one"),
])
def test_cli_fp8_refusals_are_one_line_and_exit_2(train_refusal, args, message):
    assert train_refusal(["--fp8", "rowwise", "--steps", "1", "--batch-size", "8", "--seq-len",
                          "32", "--dry-run", "--model", "tiny", *args]) == \
        f"jdist: error: {message}"
