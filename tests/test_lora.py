"""LoRA fine-tuning: every layout trains the adapters exactly as one device does, and the
base model is frozen (no gradient, no optimizer state, no gradient collective, unchanged)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdist.config import TrainConfig
from jdist.models import get_preset
from jdist.models.lora import LoraConfig, is_adapter
from jdist.parallel.pipeline import PipelineConfig
from jdist.step.from_flags import model_of
from jdist.step.state import build_model, init_adapters, init_state
from jdist.tools import hlo
from jdist.tools.equivalence import assert_matches, config, plan_of, train_steps

# 4 layers so that an interleaved pipeline has two chunks per stage.
LORA_FLAGS = {"n_layers": 4, "lora_rank": 4, "lora_alpha": 8.0}
LORA = model_of(TrainConfig.of(model="tiny", **LORA_FLAGS))
# B starts at zero, so A's gradient is zero at step 1; step 1 moves B, so A's gradient is
# nonzero from step 2: those are the gradients compared.
SETTINGS = {"steps": 3, "lr": 1e-2}
GRADS_STEP = 2


def flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def reference(single_device):
    return single_device(LORA, **SETTINGS, grads_step=GRADS_STEP)


@pytest.fixture(scope="module")
def initial():
    plan = plan_of("dp=1", **LORA_FLAGS)
    return flat(jax.tree.map(np.asarray, init_state(plan, 0).params))


_RUNS: dict = {}


def lora_run(corpus, mesh, **settings):
    key = (mesh, tuple(sorted(settings.items())))
    if key not in _RUNS:
        flags = {k: v for k, v in settings.items() if k != "pipeline"}
        _RUNS[key] = train_steps(LORA, mesh, corpus.train, config(**SETTINGS, **flags),
                                 pipeline=settings.get("pipeline"), grads_step=GRADS_STEP)
    return _RUNS[key]


# ZeRO-2/3 on a mesh with two replica axes: with 4 layers and rank 4, the data axis once
# split an adapter's stacked layers dimension (a size tie) and the gradient came back with
# twice the layers (issue 29, defect 1).
# (dp=8 alone left: its adapters' all-reduce over data runs in dp=2,fsdp=2,tp=2 too. Left
# for the suite's time: dp=2,fsdp=2,tp=2 without ZeRO, its mesh run by the ZeRO-2 and -3
# cases and ZeRO-0 by fsdp=8's; pp=2 under 1f1b, its stages run by the interleaved case,
# whose schedule is the harder one: two chunks per stage.)
LAYOUTS = [("fsdp=8", {}), ("dp=2,fsdp=2,tp=2", {"zero": 2}), ("dp=2,fsdp=2,tp=2", {"zero": 3}),
           ("pp=2", {"pipeline": PipelineConfig("interleaved", 2, 2)}),
           ("sp=2", {"cp_strategy": "ring"})]


@pytest.mark.parametrize("mesh, settings", LAYOUTS,
                         ids=["fsdp8", "dp2fsdp2tp2-zero2", "dp2fsdp2tp2-zero3",
                              "pp2-interleaved", "sp2-ring"])
def test_lora_matches_single_device_and_keeps_the_base(corpus, reference, initial, mesh,
                                                       settings):
    run = lora_run(corpus, mesh, **settings)
    assert_matches(run, reference)
    grads = flat(run.grads)
    assert grads and all("_lora" in k for k in grads), "only adapters have gradients"
    assert all(np.abs(g).max() > 0 for g in grads.values()), "every adapter is trained"
    final = flat(run.params)
    for k, v in initial.items():
        if "_lora" not in k:
            np.testing.assert_array_equal(final[k], v, err_msg=f"base {k} changed")
    moved = [k for k in initial if "_lora" in k and not np.array_equal(final[k], initial[k])]
    assert len(moved) == len([k for k in initial if "_lora" in k])


def test_fresh_adapters_compute_exactly_the_base_model():
    base, lora = build_model(dataclasses.replace(LORA, lora=None), 0), build_model(LORA, 0)
    tokens = np.arange(64).reshape(2, 32) % 256
    np.testing.assert_array_equal(np.asarray(base(tokens)), np.asarray(lora(tokens)))


def test_no_gradient_collective_touches_a_base_weight(corpus):
    """fsdp=8: base weights are all-gathered in the forward and never reduced; every
    reduction moves adapter-sized (or scalar) data only."""
    run = lora_run(corpus, "fsdp=8")
    text = run.hlo
    largest_adapter = max(np.prod(v.shape[1:]) for k, v in flat(run.params).items()
                          if "_lora" in k)
    for op in ("reduce-scatter", "all-reduce"):
        sizes = [int(np.prod(s)) for s in hlo.collective_shapes(text, op)]
        # An fsdp=8 shard of a layer's base weight (or a scattered head/table) would be
        # 512-4096 elements on this model; adapters are at most rank x 64.
        assert all(n <= largest_adapter for n in sizes), (op, sorted(sizes)[-5:])
    assert hlo.collective_counts(text)["all-gather"] > 0  # the base is still gathered


def test_optimizer_state_is_the_adapters_only():
    plan = plan_of("fsdp=8", **LORA_FLAGS)
    adapters = sum(np.prod(v.shape) for k, v in flat(plan.abstract.params).items()
                   if "_lora" in k)
    moments = [x for x in jax.tree.leaves(plan.abstract.opt_state) if x.ndim > 0]
    assert sum(np.prod(x.shape) for x in moments) == 2 * adapters  # Adam's mu and nu
    frozen = [v for k, v in flat(plan.abstract.params).items() if not is_adapter(k.split("'"))]
    assert frozen and all(x.dtype == jnp.float32 for x in frozen)  # float32 compute: as is
    bf16 = plan_of("fsdp=8", **LORA_FLAGS, compute_dtype="bfloat16")
    stored = {k: v.dtype for k, v in flat(bf16.abstract.params).items()}
    assert all(d == (jnp.float32 if "_lora" in k or "norm" in k else jnp.bfloat16)
               for k, d in stored.items()), stored


def test_checkpoints_hold_the_adapters_and_resume_elastically(tmp_path, capsys):
    """Adapters and their optimizer state only (no base); resumed onto another mesh, the
    run continues as the uninterrupted one did; bad LoRA flags are one-line errors."""
    import orbax.checkpoint as ocp

    from jdist import checkpoint as ckpt
    from jdist.config import TrainConfig
    from jdist.train.__main__ import main
    from jdist.train.loop import train

    flags = {"model": "tiny", "batch_size": 8, "seq_len": 32, "warmup": 2, "eval_every": 0,
             "log_every": 100, "lora_rank": 4, "steps": 6}
    ref = train(TrainConfig.of(**flags, mesh="fsdp=2", checkpoint_every=3,
                               run_dir=str(tmp_path / "a")))
    step3 = tmp_path / "a" / "checkpoints" / "3"
    assert ckpt.read_meta(step3)["base_saved"] is False
    saved = ocp.PyTreeCheckpointer().metadata((step3 / "state").absolute())
    saved = getattr(saved, "item_metadata", saved)
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(
        dict(saved)["params"])]
    assert names and all("_lora" in n for n in names), names
    resumed = train(TrainConfig.of(**flags, mesh="tp=2", resume=str(step3),
                                   run_dir=str(tmp_path / "b")))
    full = {r["step"]: r["loss"] for r in ref}
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for r in resumed:
        assert abs(r["loss"] - full[r["step"]]) <= 1e-5 * full[r["step"]], (r, full)
    from jdist.export import main as export

    assert export([str(step3), "--hf", str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()  # the base from the seed
    capsys.readouterr()
    for bad, says in ((["--lora-rank", "0"], "--lora-rank 0 must be between 1"),
                      (["--lora-rank", "4", "--lora-targets", "q,qkv"], "unknown target 'qkv'"),
                      (["--quantize-base", "nf4"], "add --lora-rank"),
                      (["--lora-rank", "4", "--quantize-base", "nf4"],
                       "not a whole number of NF4 blocks")):
        assert main(["--model", "tiny", "--steps", "1", *bad,
                     "--run-dir", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


# QLoRA needs whole NF4 blocks of 64 in every shard of each weight's last dimension.
QLORA_FLAGS = {"d_model": 128, "n_heads": 2, "n_kv_heads": 2, "d_ff": 256, "lora_rank": 4,
               "lora_alpha": 8.0}
QLORA = model_of(TrainConfig.of(model="tiny", **QLORA_FLAGS))
Q_SETTINGS = {**SETTINGS, "quantize_base": "nf4", "double_quant": True}


def test_qlora_matches_single_device(corpus, single_device):
    from jdist.quant import nf4

    reference = single_device(QLORA, **Q_SETTINGS, grads_step=GRADS_STEP)
    # (Pipelines: the same layer loop and `models.layers.weight`, checked by LoRA's pp runs.)
    run = train_steps(QLORA, "fsdp=2,tp=2", corpus.train, config(**Q_SETTINGS),
                      grads_step=GRADS_STEP)
    assert_matches(run, reference)
    stored = run.params["blocks"]["attn"]["wq"]
    assert isinstance(stored, nf4.Nf4) and stored.codes.dtype == np.uint8
    assert stored.absmax.dtype == np.int8  # double quantization


def test_qlora_quantizes_while_loading_shard_by_shard(tmp_path):
    """An HF checkpoint loaded onto fsdp=2,tp=2 as NF4 has exactly the codes of the float
    weights quantized whole (blocks never straddle shards); the adapters are the seed's."""
    from jdist.hf.export import write_hf
    from jdist.hf.load import load_params
    from jdist.quant import nf4

    base_cfg = dataclasses.replace(QLORA, lora=None)
    host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(build_model(base_cfg, 3))))

    def at(path):
        leaf = host
        for k in path:
            leaf = leaf[k]
        return leaf
    write_hf(tmp_path / "hf", base_cfg, at)
    plan = plan_of("fsdp=2,tp=2", **QLORA_FLAGS, compute_dtype="float32", quantize_base="nf4",
                   double_quant=True)
    params = load_params(tmp_path / "hf", plan, adapters=init_adapters(plan, 0))
    for module, name in (("attn", "wo"), ("mlp", "w_gate"), ("mlp", "w_down")):
        got = params["blocks"][module][name]
        want = nf4.quantize(at(("blocks", module, name)), True, lead=1)
        for field in ("codes", "absmax", "scale", "offset"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                          np.asarray(getattr(want, field)), err_msg=field)
        assert got.codes.sharding.spec == plan.shardings.params["blocks"][module][name].codes.spec
    np.testing.assert_array_equal(np.asarray(params["embed"]), host["embed"])
    fresh = flat(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(build_model(QLORA, 0)))))
    for k, v in flat(jax.tree.map(np.asarray, params)).items():
        if "_lora" in k:  # (jitted vs eager random draws differ in the last bit)
            np.testing.assert_allclose(v, fresh[k], rtol=1e-6, atol=1e-7)


def test_qlora_refuses_shards_that_split_nf4_blocks():
    from jdist.errors import ConfigError

    with pytest.raises(ConfigError, match="not a whole number of NF4 blocks of 64"):
        plan_of("fsdp=4", **QLORA_FLAGS, quantize_base="nf4")


def test_memory_planner_knows_lora_and_qlora(quantize="nf4"):
    """Frozen base in its storage dtype (NF4 codes and scales), gradients and optimizer
    state of the adapters only: predicted as the compiler lays them out."""
    from jdist.memory import measure, predict

    p = plan_of("fsdp=2,tp=2", **QLORA_FLAGS, batch_size=8, seq_len=64, quantize_base=quantize,
                double_quant=quantize == "nf4")
    predicted, measured = predict(p, 8, 64), measure(p, 8, 64)
    for key in ("params", "grads", "optimizer"):
        a, b = getattr(predicted, key), getattr(measured, key)
        assert abs(a - b) <= 0.05 * b, (key, a, b)
    from jdist.spmd.sharding import per_device_bytes
    from jdist.step import trainable

    adapters = per_device_bytes(trainable.select(QLORA, p.abstract.params), p.grad_shardings)
    assert predicted.grads == adapters  # float32 gradients of the adapters only
    assert abs(predicted.optimizer - 2 * adapters) <= 64  # two Adam moments (+ counters)
    assert 0.5 <= measured.activations / predicted.activations <= 2.0


def test_lora_on_a_mixture_of_experts_model_with_expert_parallelism(corpus, single_device):
    """MoE: adapters on every attention projection and on the shared expert's MLP, routed
    experts frozen; ep=2,fsdp=2 trains the adapters as one device does."""
    moe = dataclasses.replace(get_preset("moe-tiny"), shared_d_ff=32, lora=LoraConfig(4, 8.0))
    run = train_steps(moe, "ep=2,fsdp=2", corpus.train, config(**SETTINGS), grads_step=GRADS_STEP)
    assert_matches(run, single_device(moe, **SETTINGS, grads_step=GRADS_STEP))
    assert all("_lora" in k for k in flat(run.grads))
    expected = [("attn", t) for t in "qkvo"] + [("shared_mlp", t) for t in ("gate", "up", "down")]
    for module, target in expected:
        assert any(f"['{module}']['{target}_lora']" in k for k in flat(run.grads)), target


def test_readme_qlora_example_runs_on_the_shipped_preset(tmp_path, capsys):
    """The README's QLoRA command, as written but for 2 steps, trains on `qlora-tiny`: its
    base is stored as NF4 codes (whole blocks in every shard) and the adapters learn."""
    import json
    import re
    import shlex
    from pathlib import Path

    from jdist.train.__main__ import main

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("### Fine-tuning: LoRA and QLoRA", 1)[1].split("\n### ", 1)[0]
    (command,) = [c.replace("\\\n", " ") for c in re.findall(r"```bash\n(.*?)```", section,
                                                             re.DOTALL) if "nf4" in c]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "jdist.train"] and "qlora-tiny" in argv, argv
    argv = argv[3:]
    argv[argv.index("--steps") + 1] = "2"
    argv[argv.index("--run-dir") + 1] = str(tmp_path / "run")
    assert main(argv + ["--eval-every", "0", "--log-every", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"blocks\.mlp\.w_down\.+codes", out), out  # the base is NF4
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records), records
