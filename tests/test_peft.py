"""LoRA adapters in and out (`jdist.hf.peft`, `python -m jdist.export --peft/--merge-lora`),
checked against an adapter the real `peft` library saved (tests/fixtures/hf/peft-tied, on
llama-tied; tests/fixtures/make_hf_fixtures.py) and the logits of that PEFT model. No torch
or peft here: the fixture files are all that is read."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jdist.checkpoint import Checkpointer
from jdist.errors import ConfigError
from jdist.export import hf_reader, main
from jdist.hf.config import model_config
from jdist.hf.export import leaf_paths, write_hf
from jdist.hf.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_paths,
    lora_config,
    merged_reader,
    read_peft,
    write_peft,
)
from jdist.step.state import build_model

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TIED, PEFT = FIXTURES / "llama-tied", FIXTURES / "peft-tied"
RTOL = 1e-5


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _put(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


@pytest.fixture(scope="module")
def setup():
    """(base config, LoRA config, base + adapter parameters in jdist layout)."""
    base_cfg = model_config(TIED)
    cfg = dataclasses.replace(base_cfg, lora=lora_config(PEFT))
    read = hf_reader(TIED, base_cfg)
    params: dict = {}
    for path in leaf_paths(base_cfg):
        _put(params, path, read(path))
    adapters = read_peft(PEFT, base_cfg)
    for path in adapter_paths(cfg):
        _put(params, path, _at(adapters, path))
    return base_cfg, cfg, params


def logits_of(cfg, params, tokens) -> np.ndarray:
    """The jdist Llama of `cfg` with `params` (a pure dict) on `tokens`, float32."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, 0)))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    with jax.default_matmul_precision("highest"):
        return np.asarray(forward(state, jnp.asarray(tokens)))


def without_adapters(params: dict) -> dict:
    return {k: v if k != "blocks" else {m: {n: x for n, x in sub.items()
                                            if not n.endswith("_lora")}
                                        for m, sub in v.items()}
            for k, v in params.items()}


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_adapter_config_becomes_lora_config():
    lora = lora_config(PEFT)
    assert (lora.rank, lora.alpha, lora.scale) == (4, 8.0, 2.0)
    assert lora.targets == ("q", "k", "v", "o", "gate", "up", "down")


def test_logits_equal_peft(setup):
    """The jdist Llama with the PEFT adapter (unmerged) gives the PEFT model's logits."""
    _, cfg, params = setup
    logits = logits_of(cfg, params, np.load(PEFT / "tokens.npy"))
    ref = np.load(PEFT / "logits.npy")
    assert rel(logits, ref) < RTOL, rel(logits, ref)
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # The adapter matters: without it the logits are far from PEFT's.
    base_cfg, _, _ = setup
    assert rel(logits_of(base_cfg, without_adapters(params), np.load(PEFT / "tokens.npy")),
               ref) > 0.1


def test_write_peft_round_trip(tmp_path, setup):
    """read_peft -> write_peft: PEFT's own tensors (names, shapes, float32 values bitwise)
    and an adapter_config.json with the fields PEFT needs."""
    _, cfg, params = setup
    names = write_peft(tmp_path / "out", cfg, lambda p: _at(params, p), base_model=str(TIED))
    assert not (tmp_path / "out.partial").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [ADAPTER_CONFIG,
                                                                   ADAPTER_WEIGHTS]
    original, written = load_file(PEFT / ADAPTER_WEIGHTS), load_file(tmp_path / "out" /
                                                                      ADAPTER_WEIGHTS)
    assert sorted(original) == sorted(written) == sorted(names)
    for name, value in original.items():
        assert written[name].dtype == np.float32 and written[name].shape == value.shape
        assert written[name].tobytes() == value.tobytes(), name
    ours = json.loads((tmp_path / "out" / ADAPTER_CONFIG).read_text())
    theirs = json.loads((PEFT / ADAPTER_CONFIG).read_text())
    assert set(ours) <= set(theirs)  # only fields peft 0.21's LoraConfig has
    for field in ("peft_type", "r", "lora_alpha", "lora_dropout", "bias", "task_type",
                  "fan_in_fan_out", "use_dora", "use_rslora", "modules_to_save",
                  "layers_to_transform", "rank_pattern", "alpha_pattern"):
        assert ours[field] == theirs[field], field
    assert sorted(ours["target_modules"]) == theirs["target_modules"]
    assert ours["base_model_name_or_path"] == str(TIED)
    assert lora_config(tmp_path / "out") == lora_config(PEFT)
    with pytest.raises(ConfigError, match="not an empty directory"):
        write_peft(tmp_path / "out", cfg, lambda p: _at(params, p))



@pytest.mark.parametrize("changes, says", [
    ({"peft_type": "IA3"}, "only LORA"),
    ({"use_dora": True}, "use_dora=true is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "lm_head"]}, "'lm_head' has no jdist adapter"),
    ({"target_modules": ["q_proj"]}, "is not a LoRA factor"),  # the file has more
    ({"r": 8}, "has shape [4, 64], but the base model and r=8 imply [8, 64]"),
])
def test_unsupported_adapters_are_refused(tmp_path, changes, says):
    import shutil

    d = tmp_path / "adapter"
    shutil.copytree(PEFT, d)
    config = json.loads((d / ADAPTER_CONFIG).read_text())
    (d / ADAPTER_CONFIG).write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConfigError) as e:
        read_peft(d, model_config(TIED))
    assert says in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_merged_model_equals_lora_model(tmp_path, setup):
    """merged_reader's weights (W + alpha/r A.B) in a plain Llama give the LoRA model's
    logits; written by write_hf they read back bitwise."""
    base_cfg, cfg, params = setup
    merged = merged_reader(cfg, lambda p: _at(params, p))
    plain: dict = {}
    for path in leaf_paths(base_cfg):
        _put(plain, path, merged(path))
    assert not np.array_equal(plain["blocks"]["attn"]["wq"], params["blocks"]["attn"]["wq"])
    assert plain["embed"] is params["embed"]  # not adapted: passed through
    tokens = np.load(PEFT / "tokens.npy")
    lora_logits = logits_of(cfg, params, tokens)
    assert rel(logits_of(base_cfg, plain, tokens), lora_logits) < RTOL
    write_hf(tmp_path / "hf", base_cfg, merged)
    back = hf_reader(tmp_path / "hf", base_cfg)
    for path in leaf_paths(base_cfg):
        np.testing.assert_array_equal(back(path), _at(plain, path))


# ----------------------------------------------------------------- python -m jdist.export


def save_checkpoint(root, cfg, params: dict, train: dict) -> str:
    """A checkpoint as `python -m jdist.train` writes it (state "params", metadata "model"
    and "config"), holding `params`; returns its step directory."""
    ckpt = Checkpointer(root, use_async=False)
    meta = {"step": 1, "model": dataclasses.asdict(cfg), "config": train}
    ckpt.save(1, {"params": jax.tree.map(jnp.asarray, params)}, json.loads(json.dumps(meta)))
    ckpt.close()
    return str(root / "1")


def adapters_only(cfg, params) -> dict:
    out: dict = {}
    for path in adapter_paths(cfg):
        _put(out, path, _at(params, path))
    return out


def export(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_export_lora_checkpoint(tmp_path, capsys, setup):
    """A checkpoint holding only the adapters, trained from llama-tied (--init-from):
    --peft gives PEFT's tensors back; --hf --merge-lora a Llama with PEFT's logits."""
    base_cfg, cfg, params = setup
    step = save_checkpoint(tmp_path / "run", cfg, adapters_only(cfg, params),
                           {"init_from": str(TIED), "save_base": False,
                            "quantize_base": "none", "double_quant": False})
    code, err = export(capsys, step, "--hf", tmp_path / "hf")
    assert code == 2 and "pass --merge-lora" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()

    code, err = export(capsys, step, "--hf", tmp_path / "hf", "--merge-lora",
                       "--peft", tmp_path / "peft")
    assert code == 0, err
    original, written = load_file(PEFT / ADAPTER_WEIGHTS), load_file(tmp_path / "peft" /
                                                                      ADAPTER_WEIGHTS)
    assert sorted(original) == sorted(written)
    assert all(written[k].tobytes() == v.tobytes() for k, v in original.items())
    assert model_config(tmp_path / "hf") == base_cfg
    read = hf_reader(tmp_path / "hf", base_cfg)
    merged: dict = {}
    for path in leaf_paths(base_cfg):
        _put(merged, path, read(path))
    logits = logits_of(base_cfg, merged, np.load(PEFT / "tokens.npy"))
    assert rel(logits, np.load(PEFT / "logits.npy")) < RTOL


@pytest.mark.parametrize("argv, says", [
    (("--hf", "OUT", "--merge-lora"), "has no LoRA adapters; drop --merge-lora"),
    (("--peft", "OUT"), "has no LoRA adapters"),
])
def test_export_refuses_lora_flags_without_lora(tmp_path, capsys, setup, argv, says):
    base_cfg, _, params = setup
    step = save_checkpoint(tmp_path / "run", base_cfg, without_adapters(params), {})
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    code, err = export(capsys, step, *argv)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_export_without_init_from_merges_into_the_seed_base(tmp_path, capsys, setup):
    """A LoRA run from no Hugging Face model trained on the seed's base: that is what the
    merge starts from (the untouched embedding shows it)."""
    from jdist.export import seed_reader

    _, cfg, params = setup
    step = save_checkpoint(tmp_path / "run", cfg, adapters_only(cfg, params),
                           {"init_from": "", "save_base": False})
    code, err = export(capsys, step, "--hf", tmp_path / "hf", "--merge-lora")
    assert code == 0, err
    merged = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        merged.update(load_file(f))
    seed = seed_reader(dataclasses.replace(cfg, lora=None), 0)
    np.testing.assert_array_equal(merged["model.embed_tokens.weight"], seed(("embed",)))


@pytest.mark.parametrize("save_base", [False, True], ids=["init-from", "save-base"])
def test_export_merges_into_the_nf4_base(tmp_path, capsys, save_base):
    """--quantize-base nf4: the adapters are merged into dequantize(quantize(W)) of every
    block projection (what training computed with), the base read from --init-from or from
    the checkpoint's own NF4 fields (--save-base); norms and the embedding are kept."""
    pytest.importorskip("jdist.quant.nf4")
    from jdist.export import nf4_round_trip
    from jdist.models.lora import LoraConfig
    from jdist.step import trainable

    # head_dim 64: NF4 blocks of 64 run along the last dimension of every projection.
    base_cfg = dataclasses.replace(model_config(TIED), d_model=128, n_heads=2, n_kv_heads=1,
                                   head_dim=64, d_ff=128)
    cfg = dataclasses.replace(base_cfg, lora=LoraConfig(4, 8.0, ("q", "o", "down")))
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, 0))))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0, 0.1, a.shape).astype(np.float32), abstract)
    train = {"save_base": save_base, "quantize_base": "nf4", "double_quant": True}
    if save_base:  # the parameters as the step stores them: Nf4 where quantized
        saved = jax.jit(lambda p: trainable.to_storage(cfg, p, jnp.float32, "nf4", True))(
            params)
        train["init_from"] = ""
    else:
        write_hf(tmp_path / "base", base_cfg, lambda p: _at(params, p))
        saved, train["init_from"] = adapters_only(cfg, params), str(tmp_path / "base")
    step = save_checkpoint(tmp_path / "run", cfg, saved, train)
    code, err = export(capsys, step, "--hf", tmp_path / "hf", "--merge-lora")
    assert code == 0, err
    read = hf_reader(tmp_path / "hf", base_cfg)
    projections = {p for p in leaf_paths(base_cfg) if p[0] == "blocks" and "norm" not in p[1]}
    assert len(projections) == 7
    for path in leaf_paths(base_cfg):
        w = _at(params, path)
        if path in projections:
            q = nf4_round_trip(w, True)
            assert 0 < rel(q, w) < 0.2  # 4 bits: ~10% error
            w = q
        want = merged_reader(cfg, lambda p, w=w, path=path: w if p == path else _at(params, p))
        np.testing.assert_array_equal(read(path), want(path), err_msg=str(path))


def test_train_lora_then_export(tmp_path, capsys):
    """`python -m jdist.train --init-from llama-tied --lora-rank 4` (2 steps, a checkpoint
    of the adapters alone) -> `python -m jdist.export --hf --merge-lora --peft`: the merged
    Llama (read back by jdist's HF loader) gives the LoRA model's logits, and the PEFT
    directory holds the checkpoint's adapters."""
    from jdist.checkpoint import resolve_explicit
    from jdist.export import checkpoint_reader

    run = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "jdist.train", "--init-from", str(TIED), "--lora-rank", "4",
         "--mesh", "dp=1", "--steps", "2", "--checkpoint-every", "2", "--batch-size", "4",
         "--seq-len", "16", "--eval-every", "0", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    code, err = export(capsys, run, "--hf", tmp_path / "hf", "--merge-lora",
                       "--peft", tmp_path / "peft")
    assert code == 0, err

    cfg, read_ckpt = checkpoint_reader(resolve_explicit(str(run), "test"))
    assert cfg.lora is not None and cfg.lora.rank == 4
    base_cfg = dataclasses.replace(cfg, lora=None)
    assert model_config(tmp_path / "hf") == base_cfg
    read_base, read_merged = hf_reader(TIED, base_cfg), hf_reader(tmp_path / "hf", base_cfg)
    lora_params, merged_params = {}, {}
    for path in leaf_paths(base_cfg):
        _put(lora_params, path, read_base(path))
        _put(merged_params, path, read_merged(path))
    for path in adapter_paths(cfg):
        _put(lora_params, path, read_ckpt(path))
    assert any(np.abs(_at(lora_params, p)).max() > 0 for p in adapter_paths(cfg)
               if p[-1] == "b"), "the adapters did not train"
    tokens = np.load(PEFT / "tokens.npy")
    lora_logits = logits_of(cfg, lora_params, tokens)
    assert rel(logits_of(base_cfg, merged_params, tokens), lora_logits) < RTOL
    adapters = read_peft(tmp_path / "peft", base_cfg)
    for path in adapter_paths(cfg):
        np.testing.assert_array_equal(_at(adapters, path), _at(lora_params, path))
