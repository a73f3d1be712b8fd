"""Hugging Face checkpoints in and out (`jdist.hf`, `python -m jdist.export`), checked
against fixtures that `transformers` wrote (tests/fixtures/make_hf_fixtures.py): the
logits of `LlamaForCausalLM`, its tensors bitwise, and sharded loading that reads only
what each process holds. `qwen3` is a `Qwen3ForCausalLM` (Llama's decoder with RMSNorm on
each query and key head, `ModelConfig.qk_norm`)."""

import dataclasses
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from hf_roundtrip import assert_round_trip_is_bitwise, at, hf_tensors, loaded

from jdist.errors import ConfigError
from jdist.hf.config import model_config
from jdist.hf.export import write_hf
from jdist.parallel.pipeline.layer_order import to_model_order
from jdist.step.state import build_model

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
UNTIED, TIED = FIXTURES / "llama-untied", FIXTURES / "llama-tied"
QWEN3, MIXTRAL, QWEN3_MOE = FIXTURES / "qwen3", FIXTURES / "mixtral", FIXTURES / "qwen3-moe"
UNNORMALISED = FIXTURES / "qwen3-moe-unnormalised"  # norm_topk_prob false
FAMILIES = [UNTIED, TIED, QWEN3, MIXTRAL, QWEN3_MOE, UNNORMALISED]
FAMILY_IDS = ["untied", "tied", "qwen3", "mixtral", "qwen3-moe", "qwen3-moe-unnormalised"]
RTOL = 1e-5


def test_config_json_becomes_the_model():
    untied, tied = model_config(UNTIED), model_config(TIED)
    assert (untied.n_kv_heads, untied.rope_theta, untied.norm_eps) == (4, 500_000.0, 1e-5)
    assert untied.rope_scaling.factor == 8.0 and untied.rope_scaling.original_max_position == 256
    assert not untied.tie_embeddings and tied.tie_embeddings
    assert (tied.n_kv_heads, tied.rope_scaling, tied.norm_eps) == (2, None, 1e-6)
    assert not untied.qk_norm and not tied.qk_norm
    qwen3 = model_config(QWEN3)
    assert qwen3.qk_norm and (qwen3.dim_per_head, qwen3.rope_theta) == (16, 1_000_000.0)
    mixtral, qwen3_moe = model_config(MIXTRAL), model_config(QWEN3_MOE)
    assert (mixtral.n_experts, mixtral.top_k, mixtral.d_ff, mixtral.qk_norm) == (4, 2, 128, False)
    assert (qwen3_moe.n_experts, qwen3_moe.top_k, qwen3_moe.d_ff, qwen3_moe.qk_norm) == \
        (8, 2, 32, True)  # the experts' own width, moe_intermediate_size
    assert qwen3_moe.norm_topk_prob and not model_config(UNNORMALISED).norm_topk_prob


@pytest.mark.parametrize("hf_dir", FAMILIES, ids=FAMILY_IDS)
def test_logits_equal_transformers(hf_dir):
    plan, params = loaded(hf_dir)
    ref = np.load(hf_dir / "reference.npz")
    with jax.default_matmul_precision("highest"):
        model = nnx.merge(plan.graphdef, jax.tree.map(np.asarray, params))
        logits = np.asarray(model(ref["input_ids"]))
    rel = np.linalg.norm(logits - ref["logits"]) / np.linalg.norm(ref["logits"])
    assert rel < RTOL, rel


@pytest.mark.parametrize("mesh", ["fsdp=8", "dp=2,fsdp=2,tp=2", "pp=2,tp=2"])
def test_every_mesh_loads_the_same_parameters(mesh):
    _, reference = loaded(UNTIED)
    plan, params = loaded(UNTIED, mesh)
    assert any(len(p.sharding.device_set) > 1 for p in jax.tree.leaves(params))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_interleaved_stages_read_their_layers(tmp_path):
    """A 4-layer model (the fixtures have 2) written by `write_hf`, loaded onto pp=2 with 2
    virtual stages: stored in interleaved order, the same weights in model order."""
    cfg = dataclasses.replace(model_config(UNTIED), n_layers=4)
    source = nnx.to_pure_dict(nnx.state(build_model(cfg, 1)))
    write_hf(tmp_path / "hf", cfg, lambda path: np.asarray(at(source, path)))
    plan, params = loaded(tmp_path / "hf", "pp=2,fsdp=2", pp_schedule="interleaved",
                          pp_virtual_stages=2)
    got = to_model_order(plan, jax.tree.map(np.asarray, params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(source)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("hf_dir", FAMILIES, ids=FAMILY_IDS)
def test_round_trip_is_bitwise(tmp_path, hf_dir):
    plan, params = loaded(hf_dir)
    assert_round_trip_is_bitwise(hf_dir, tmp_path / "out", plan, params)


def test_train_checkpoint_export_round_trip(tmp_path):
    """HF -> `--init-from` -> an Orbax checkpoint (lr 0: the weights unchanged) ->
    `python -m jdist.export` -> the same tensors, bitwise; config.json keeps the source's
    bos/eos ids and max_position_embeddings, and generation_config.json is the source's,
    from the checkpoint's metadata (the source directory is gone by the export); every file
    has the user's umask (safetensors alone would create 0600)."""
    import os

    source, run = tmp_path / "source", tmp_path / "run"
    shutil.copytree(UNTIED, source)
    train = subprocess.run(
        [sys.executable, "-m", "jdist.train", "--init-from", str(source), "--mesh", "fsdp=2",
         "--steps", "1", "--lr", "0", "--batch-size", "4", "--seq-len", "16",
         "--eval-every", "0", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    shutil.rmtree(source)
    out = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "jdist.export", str(run), "--hf", str(out),
         "--max-shard-size", "100KB", "--tokenizer", str(UNTIED)],
        capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o027))
    assert export.returncode == 0, export.stderr
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "tokenizer.json").exists()
    original, exported = hf_tensors(UNTIED), hf_tensors(out)
    assert sorted(original) == sorted(exported)
    assert all(exported[k].tobytes() == v.tobytes() for k, v in original.items())
    was, now = (json.loads((d / "config.json").read_text()) for d in (UNTIED, out))
    carried = ("bos_token_id", "eos_token_id", "max_position_embeddings")
    assert {k: now[k] for k in carried} == {k: was[k] for k in carried}
    assert was["max_position_embeddings"] != 8192  # not the default it used to write
    assert json.loads((out / "generation_config.json").read_text()) == \
        json.loads((UNTIED / "generation_config.json").read_text())
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes.values()) == {0o640}, modes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_each_read_their_half():
    worker = Path(__file__).parent / "workers" / "hf_load.py"
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(worker), str(UNTIED), coordinator, str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    reports = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    for r in reports:
        assert r["bytes_read"] < 0.6 * r["total"], r
        assert r["logits_rel_err"] < RTOL, r


def _copy_with_config(tmp_path, **changes) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(UNTIED, d)
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("changes, says", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 2}, "shape"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
      "use_sliding_window": True}, "sliding attention window"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
      "num_experts_per_tok": 2, "sliding_window": 4096}, "sliding attention window"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]},
     "dense layers between the MoE ones"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized \\(gptq"),
])
def test_unsupported_checkpoints_are_refused(tmp_path, changes, says):
    d = _copy_with_config(tmp_path, **changes)
    with pytest.raises(ConfigError, match=says) as e:
        loaded(d)
    assert "\n" not in str(e.value)


def test_cli_refuses_a_directory_without_config(tmp_path, train_refusal):
    (tmp_path / "empty").mkdir()
    assert "config.json" in train_refusal(["--init-from", tmp_path / "empty", "--steps", "1",
                                           "--run-dir", tmp_path / "run"])
    assert not (tmp_path / "run").exists()


def test_export_loads_in_transformers(tmp_path):
    """Where transformers is installed (not in CI: it needs torch): `from_pretrained` on
    the exported directory reproduces the fixture's logits."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    plan, params = loaded(UNTIED)
    host = jax.tree.map(np.asarray, params)
    write_hf(tmp_path / "out", plan.model, lambda path: at(host, path))
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out",
                                                          attn_implementation="eager")
    ref = np.load(UNTIED / "reference.npz")
    with torch.no_grad():
        logits = model(torch.tensor(ref["input_ids"]).long()).logits.numpy()
    np.testing.assert_array_equal(logits, ref["logits"])
