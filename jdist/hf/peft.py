"""LoRA adapters as the Hugging Face `peft` library stores them, and merged into the base.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors` with, for
every adapted `nn.Linear` (weight [out, in]) of layer i, `lora_A` [r, in] and `lora_B`
[out, r] under `base_model.model.` + the module's name, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`; the update is
(lora_alpha / r) * B @ A. jdist's adapter of a weight with input dims I and output dims O
holds a [*I, r] and b [r, *O] (`models.lora`), so A = a flattened to [prod(I), r],
transposed, and B = b flattened to [r, prod(O)], transposed: heads are flattened h*D + d
on both sides (`jdist.hf.layout`).

`read_peft` reads such a directory into jdist's parameter layout, `write_peft` writes one
(staged next to OUT and renamed when complete), and `merged_reader` folds adapters into
their base weights (W + (alpha/r) * A.B in float32) so `jdist.hf.export.write_hf` writes a
plain Llama."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jdist.errors import require
from jdist.hf import layout
from jdist.hf.export import staged
from jdist.models.config import ModelConfig
from jdist.models.lora import SUFFIX, TARGETS, LoraConfig
from jdist.models.names import BLOCKS

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> LlamaForCausalLM
# jdist target -> the HF module it adapts (the last part of its name).
MODULES = {t: layout.hf_name(layout.LLAMA, (BLOCKS, *TARGETS[t]), 0).split(".")[-2]
           for t in TARGETS}
# Fields of the LoRA variants jdist's adapters cannot represent, with their plain values
# (written into adapter_config.json; on reading, any empty value counts as plain).
PLAIN = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
         "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
         "modules_to_save": None}
# Newer variants, checked on reading only (older peft versions do not know the fields).
PLAIN_NEWER = {"lora_bias": False, "target_parameters": None, "layer_replication": None,
               "use_qalora": False, "trainable_token_indices": None, "exclude_modules": None}

ReadLeaf = Callable[[tuple[str, ...]], np.ndarray]


def base_path(target: str) -> tuple[str, ...]:
    """The jdist path of the base weight `target` adapts, e.g. ("blocks", "attn", "wq")."""
    return (BLOCKS, *TARGETS[target])


def adapter_path(target: str, which: str) -> tuple[str, ...]:
    """The jdist path of an adapter factor: which = "a" or "b"."""
    module, _ = TARGETS[target]
    return (BLOCKS, module, target + SUFFIX, which)


def adapter_paths(cfg: ModelConfig) -> list[tuple[str, ...]]:
    return [adapter_path(t, w) for t in _targets(cfg.lora) for w in ("a", "b")]


def weight_dims(cfg: ModelConfig, target: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of the per-layer base weight `target` adapts."""
    e, f, hd = cfg.d_model, cfg.d_ff, cfg.dim_per_head
    return {"q": ((e,), (cfg.n_heads, hd)), "k": ((e,), (cfg.n_kv_heads, hd)),
            "v": ((e,), (cfg.n_kv_heads, hd)), "o": ((cfg.n_heads, hd), (e,)),
            "gate": ((e,), (f,)), "up": ((e,), (f,)), "down": ((f,), (e,))}[target]


def peft_name(target: str, layer: int, which: str) -> str:
    """PEFT's tensor name of factor `which` ("A" or "B") of `target` in `layer`."""
    module = layout.hf_name(layout.LLAMA, base_path(target), layer).removesuffix(".weight")
    return f"{PREFIX}{module}.lora_{which}.weight"


def _targets(lora: LoraConfig | None) -> list[str]:
    require(lora is not None, "this model has no LoRA adapters (ModelConfig.lora is None)")
    return [t for t in TARGETS if t in lora.targets]  # model order


# ------------------------------------------------------------------------------ merging


def delta(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """scale * A.B of stacked factors a [L, *I, r], b [L, r, *O] -> [L, *I, *O], float32."""
    n, r = a.shape[0], a.shape[-1]
    a2 = np.asarray(a, np.float32).reshape(n, -1, r)
    b2 = np.asarray(b, np.float32).reshape(n, r, -1)
    return (np.float32(scale) * np.matmul(a2, b2)).reshape(*a.shape[:-1], *b.shape[2:])


def merged_reader(cfg: ModelConfig, read_leaf: ReadLeaf) -> ReadLeaf:
    """`read_leaf` of the base model (`dataclasses.replace(cfg, lora=None)`) whose adapted
    weights have `cfg.lora`'s adapters merged in: W + (alpha/r) * A.B, float32. `read_leaf`
    gives cfg's parameters (base and adapters) in model layer order."""
    adapted = {base_path(t): t for t in _targets(cfg.lora)}
    scale = cfg.lora.scale

    def read(path: tuple[str, ...]) -> np.ndarray:
        path = tuple(path)
        w = read_leaf(path)
        if path not in adapted:
            return w
        t = adapted[path]
        d = delta(read_leaf(adapter_path(t, "a")), read_leaf(adapter_path(t, "b")), scale)
        require(d.shape == w.shape, f"LoRA adapter {t}: A.B has shape {list(d.shape)} but "
                                    f"its weight {'/'.join(path)} has {list(w.shape)}; the "
                                    "checkpoint does not match its model config")
        return np.asarray(w, np.float32) + d
    return read


# ------------------------------------------------------------------------------ reading


def lora_config(peft_dir: str | Path) -> LoraConfig:
    """The `LoraConfig` of a PEFT LoRA directory; LoRA variants that jdist's adapters cannot
    represent (DoRA, rsLoRA, biases, per-module ranks, ...) are refused in one line."""
    path = Path(peft_dir) / ADAPTER_CONFIG
    require(path.is_file(), f"{peft_dir}: no {ADAPTER_CONFIG}; pass a directory written by "
                            "PeftModel.save_pretrained")
    try:
        c = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        require(False, f"{path} is not valid JSON ({e}); re-save the adapter")
    require(c.get("peft_type") == "LORA", f"{path}: peft_type {c.get('peft_type')!r}; only "
                                          "LORA adapters can be imported")
    for field, plain in {**PLAIN, **PLAIN_NEWER}.items():
        value = c.get(field, plain)
        require(value == plain or (not plain and not value),
                f"{path}: {field}={json.dumps(value)} is not supported (jdist's LoRA is plain "
                f"x.A.B*alpha/r on whole projections); use an adapter with {field}="
                f"{json.dumps(plain)}")
    modules = c.get("target_modules")
    if modules == "all-linear":
        modules = list(MODULES.values())
    names = {m: t for t, m in MODULES.items()}
    require(isinstance(modules, list) and modules,
            f"{path}: target_modules {json.dumps(modules)} must be a list of module names "
            f"(a subset of {', '.join(MODULES.values())})")
    unknown = [m for m in modules if m not in names]
    require(not unknown, f"{path}: target module {unknown[0] if unknown else ''!r} has no jdist "
                         f"adapter; use a subset of {', '.join(MODULES.values())}")
    r = c.get("r")
    require(isinstance(r, int) and r >= 1, f"{path}: r={r!r} must be a positive integer")
    targets = tuple(t for t in TARGETS if MODULES[t] in modules)
    return LoraConfig(rank=r, alpha=float(c.get("lora_alpha", 8)), targets=targets)


def read_peft(peft_dir: str | Path, cfg: ModelConfig) -> dict:
    """The adapters of a PEFT LoRA directory as jdist parameters ({"blocks": {"attn":
    {"q_lora": {"a": [L, E, r], "b": [L, r, H, D]}, ...}, "mlp": {...}}}, float32, model
    layer order) for base model `cfg`. If `cfg.lora` is set it must agree with the
    directory's adapter_config.json; `lora_config(peft_dir)` gives the one to use."""
    lora = lora_config(peft_dir)
    if cfg.lora is not None:
        same = (cfg.lora.rank, cfg.lora.alpha, set(cfg.lora.targets)) == \
            (lora.rank, lora.alpha, set(lora.targets))
        require(same, f"{peft_dir}: adapter rank {lora.rank}, alpha {lora.alpha}, targets "
                      f"{','.join(lora.targets)} differ from this model's LoRA (rank "
                      f"{cfg.lora.rank}, alpha {cfg.lora.alpha}, targets "
                      f"{','.join(cfg.lora.targets)}); drop the --lora flags")
    file = Path(peft_dir) / ADAPTER_WEIGHTS
    require(file.is_file(), f"{peft_dir}: no {ADAPTER_WEIGHTS}; save the adapter with "
                            "safe_serialization=True (the default)")
    params: dict = {}
    with safe_open(file, "numpy") as f:
        stored = set(f.keys())
        expected = set()
        for t in TARGETS:
            if t not in lora.targets:
                continue
            ins, outs = weight_dims(cfg, t)
            shapes = {"A": (lora.rank, int(np.prod(ins))), "B": (int(np.prod(outs)), lora.rank)}
            layers = {"A": [], "B": []}
            for i in range(cfg.n_layers):
                for which in ("A", "B"):
                    name = peft_name(t, i, which)
                    expected.add(name)
                    require(name in stored, f"{file}: tensor {name} is missing; the adapter "
                                            "does not match adapter_config.json or the base "
                                            "model's config.json")
                    x = f.get_tensor(name)
                    require(tuple(x.shape) == shapes[which],
                            f"{file}: tensor {name} has shape {list(x.shape)}, but the base "
                            f"model and r={lora.rank} imply {list(shapes[which])}")
                    layers[which].append(np.asarray(x, np.float32))
            a = np.stack([x.T.reshape(*ins, lora.rank) for x in layers["A"]])
            b = np.stack([x.T.reshape(lora.rank, *outs) for x in layers["B"]])
            module, _ = TARGETS[t]
            params.setdefault(BLOCKS, {}).setdefault(module, {})[t + SUFFIX] = {"a": a, "b": b}
    extra = sorted(stored - expected)
    require(not extra, f"{file}: tensor {extra[0] if extra else ''} is not a LoRA factor of "
                       f"this {cfg.n_layers}-layer model's {', '.join(MODULES.values())}; "
                       "jdist imports plain LoRA adapters only")
    return params


# ------------------------------------------------------------------------------ writing


def peft_config(cfg: ModelConfig, base_model: str = "") -> dict:
    """adapter_config.json for `cfg.lora`, with the fields `peft.LoraConfig` reads."""
    targets = _targets(cfg.lora)
    alpha = cfg.lora.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.lora.rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": [MODULES[t] for t in targets], "lora_dropout": 0.0,
        "inference_mode": True, "init_lora_weights": True, "revision": None,
        **PLAIN,
    }


def peft_tensors(cfg: ModelConfig, read_leaf: ReadLeaf) -> dict[str, np.ndarray]:
    """PEFT's tensors (name -> float32 array) of `cfg`'s adapters, read by `read_leaf`."""
    out = {}
    r = cfg.lora.rank
    for t in _targets(cfg.lora):
        a, b = read_leaf(adapter_path(t, "a")), read_leaf(adapter_path(t, "b"))
        ins, outs = weight_dims(cfg, t)
        want = {"a": (cfg.n_layers, *ins, r), "b": (cfg.n_layers, r, *outs)}
        for which, x in (("a", a), ("b", b)):
            require(tuple(x.shape) == want[which],
                    f"LoRA adapter {'/'.join(adapter_path(t, which))} has shape "
                    f"{list(x.shape)}, expected {list(want[which])}")
        for i in range(cfg.n_layers):
            out[peft_name(t, i, "A")] = np.ascontiguousarray(
                np.asarray(a[i], np.float32).reshape(-1, r).T)
            out[peft_name(t, i, "B")] = np.ascontiguousarray(
                np.asarray(b[i], np.float32).reshape(r, -1).T)
    return out


def write_peft(out_dir: str | Path, cfg: ModelConfig, read_leaf: ReadLeaf,
               base_model: str = "") -> dict[str, tuple[int, ...]]:
    """Write `cfg.lora`'s adapters, each factor fetched by `read_leaf(path)` (model layer
    order), as a PEFT LoRA directory for `LlamaForCausalLM` (`PeftModel.from_pretrained`
    loads it); `base_model` goes into `base_model_name_or_path`. A and B are float32.
    Returns {tensor name: shape}."""
    out = Path(out_dir)
    require(not out.exists() or (out.is_dir() and not any(out.iterdir())),
            f"--peft {out}: exists and is not an empty directory; choose a new output directory")
    require(not cfg.n_experts, "PEFT export supports dense Llama models only; this model has "
                               "experts")
    tensors = peft_tensors(cfg, read_leaf)
    config = peft_config(cfg, base_model)
    with staged(out) as staging:
        save_file(tensors, staging / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True)
                                              + "\n")
    return {name: tuple(x.shape) for name, x in tensors.items()}


def with_lora(cfg: ModelConfig, peft_dir: str | Path) -> ModelConfig:
    """`cfg` (a base model) with the LoRA configuration of a PEFT directory."""
    return dataclasses.replace(cfg, lora=lora_config(peft_dir))
