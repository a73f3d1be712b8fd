"""Hugging Face `config.json` <-> `ModelConfig` for the Llama family (Llama 2, 3, 3.1, 3.2,
3.3) and Qwen3 (dense: Llama's decoder with RMSNorm on each query and key head): GQA, tied
or untied embeddings, `rope_theta`, `rope_scaling` of type `llama3`, `rms_norm_eps`,
`head_dim`. A field the model cannot represent (biases, another rope type, another
activation, Qwen3's sliding window) is refused in one line that names it."""

from __future__ import annotations

import json
from pathlib import Path

from jdist.errors import require
from jdist.hf import deepseek, gemma, gpt_oss
from jdist.hf.family import refuse_quantized
from jdist.models.config import ModelConfig, RopeScaling

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# config.json fields the model's shape does not decide but transformers reads: the special
# token ids (generation stops at eos) and the context the model was made for. An export
# carries them over from the directory a run started from (`source_fields`).
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
DEFAULT_MAX_POSITION = 8192  # when no source says (a run trained from scratch)
ARCHITECTURE = "LlamaForCausalLM"
# model_type -> the architecture transformers builds for it; Qwen3's is `qk_norm`.
ARCHITECTURES = {"llama": ARCHITECTURE, "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
QK_NORM_TYPES, MOE_TYPES = ("qwen3", "qwen3_moe"), ("mixtral", "qwen3_moe")
# HF LlamaConfig's defaults where config.json leaves a field out.
HF_DEFAULT_EPS, HF_DEFAULT_THETA = 1e-6, 10_000.0


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / CONFIG
    require(Path(hf_dir).is_dir(), f"--init-from {hf_dir}: not a directory; pass a Hugging Face "
                                   "model directory (config.json + *.safetensors)")
    # A jdist run's config.json is its flags, not a model's: say what the directory is.
    require(not is_jdist_run(hf_dir),
            f"--init-from {hf_dir}: that is a jdist training run or checkpoint, not a Hugging "
            f"Face model; continue training it with --resume {hf_dir}, generate from it with "
            f"--checkpoint {hf_dir}, or convert it with python -m jdist.export {hf_dir} --hf OUT")
    require(path.is_file(), f"--init-from {hf_dir}: no {CONFIG} there; pass the directory "
                            "save_pretrained wrote (config.json + *.safetensors)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        require(False, f"{path} is not valid JSON ({e}); re-download or re-export it")


def is_jdist_run(path: str | Path) -> bool:
    """A `python -m jdist.train` run directory or one of its checkpoints (step directories)."""
    from jdist.checkpoint import MANIFEST, STATE

    return any((Path(path) / name).exists() for name in
               ("checkpoints", "metrics.jsonl", MANIFEST, STATE))


def rope_fields(c: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict or {}) from either form: `rope_theta` + `rope_scaling`
    (the Llama 3.x hub checkpoints), or `rope_parameters` (as transformers 5 writes)."""
    params = c.get("rope_parameters") or {}
    theta = float(c.get("rope_theta", params.get("rope_theta", HF_DEFAULT_THETA)))
    scaling = c.get("rope_scaling") or params
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, {}
    return theta, scaling


def _refuse_unsupported(c: dict, where: str) -> None:
    kind = c.get("model_type", "llama")
    archs = c.get("architectures") or [ARCHITECTURES.get(kind, "")]
    require(kind in ARCHITECTURES and archs == [ARCHITECTURES[kind]],
            f"{where}: architecture {archs} (model_type {kind!r}) is not supported; only "
            f"{' and '.join(ARCHITECTURES.values())} checkpoints can be imported")
    # Quantized community re-uploads (GPTQ, AWQ, bitsandbytes) store packed tensors under
    # other names: refused here rather than as a missing-tensor error halfway through loading.
    refuse_quantized(c, where, "a quantized re-upload; --qlora quantizes bfloat16 weights "
                               "itself")
    window = c.get("use_sliding_window", kind == "mixtral" and c.get("sliding_window"))
    require(not window, f"{where}: a sliding attention window is not read from {kind} configs "
            "yet (the gpt-oss and Gemma 3 readers carry theirs); use a checkpoint without one")
    if kind == "qwen3_moe":
        require(c.get("decoder_sparse_step", 1) == 1 and not c.get("mlp_only_layers"),
                f"{where}: dense layers between the MoE ones (decoder_sparse_step, "
                "mlp_only_layers) are not supported; every block must be MoE")
    for field in ("attention_bias", "mlp_bias"):
        require(not c.get(field, False), f"{where}: {field}=true is not supported (jdist's "
                                         "Llama has no biases); use a checkpoint without them")
    act = c.get("hidden_act", "silu")
    require(act == "silu", f"{where}: hidden_act={act!r} is not supported; jdist's MLP is "
                           "SwiGLU (silu)")
    require(c.get("pretraining_tp", 1) == 1, f"{where}: pretraining_tp="
            f"{c.get('pretraining_tp')} is not supported; re-save with pretraining_tp=1")
    _, scaling = rope_fields(c)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        require(kind == "llama3", f"{where}: rope type {kind!r} is not supported; only "
                                  "'llama3' scaling (or none) is")


def model_config(hf_dir: str | Path) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face Llama directory, validated."""
    c = read_config(hf_dir)
    where = str(Path(hf_dir) / CONFIG)
    if c.get("model_type") == deepseek.MODEL_TYPE:
        return deepseek.model_config(c, where, rope_fields(c))
    if c.get("model_type") == gemma.MODEL_TYPE:
        return gemma.model_config(c, where)
    if c.get("model_type") == gpt_oss.MODEL_TYPE:
        return gpt_oss.model_config(c, where, rope_fields(c))
    _refuse_unsupported(c, where)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size"):
        require(field in c, f"{where}: missing field {field!r}; not a complete Llama config")
    theta, scaling = rope_fields(c)
    rope = None
    if scaling:
        rope = RopeScaling(factor=float(scaling["factor"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_max_position=int(
                               scaling["original_max_position_embeddings"]))
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    kind = c.get("model_type", "llama")
    moe = {}
    if kind in MOE_TYPES:  # HF trains with the auxiliary loss alone: no router z-loss
        # Qwen3-MoE's hub configs say num_experts; transformers 5 writes num_local_experts.
        moe = dict(n_experts=int(c.get("num_local_experts") or c["num_experts"]),
                   top_k=int(c["num_experts_per_tok"]), moe_routing="dropless",
                   # Mixtral always renormalises; Qwen3-MoE as its config says (default off)
                   norm_topk_prob=kind != "qwen3_moe" or bool(c.get("norm_topk_prob", False)),
                   aux_loss_weight=float(c.get("router_aux_loss_coef", 0.01)),
                   z_loss_weight=0.0)
    d_ff = int(c["moe_intermediate_size" if kind == "qwen3_moe" else "intermediate_size"])
    cfg = ModelConfig(
        vocab_size=int(c["vocab_size"]), d_model=int(c["hidden_size"]),
        n_layers=int(c["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(c.get("num_key_value_heads") or heads), d_ff=d_ff,
        head_dim=0 if head_dim * heads == int(c["hidden_size"]) else head_dim,
        rope_theta=theta, rope_scaling=rope,
        norm_eps=float(c.get("rms_norm_eps", HF_DEFAULT_EPS)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=kind in QK_NORM_TYPES, **moe)
    cfg.validate()
    return cfg


def source_fields(hf_dir: str | Path) -> dict:
    """What an export of a model started from `hf_dir` keeps of it: {"config": its CARRIED
    fields, "generation_config": its generation_config.json (sampling defaults, eos lists),
    when it has one}. Recorded in every checkpoint, so an export needs not the directory."""
    c = read_config(hf_dir)
    out = {"config": {k: c[k] for k in CARRIED if k in c}}
    gen = Path(hf_dir) / GENERATION_CONFIG
    if gen.is_file():
        try:
            out["generation_config"] = json.loads(gen.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # transformers would refuse it too; the export writes one from config.json
    return out


def generation_config(config: dict) -> dict:
    """generation_config.json from a config.json, as transformers derives it."""
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if config.get(k) is not None}
    return {"_from_model_config": True, **ids, "use_cache": True}


def hf_config(cfg: ModelConfig, torch_dtype: str = "float32",
              carried: dict | None = None) -> dict:
    """config.json for `cfg`, as `LlamaConfig` (or, with `qk_norm`, `Qwen3Config`) writes
    it, with the `carried` fields (CARRIED: special token ids, max_position_embeddings) of
    the model it came from."""
    carried = {k: v for k, v in (carried or {}).items() if k in CARRIED}
    if cfg.kv_lora_rank:
        return deepseek.hf_config(cfg, torch_dtype, carried)
    if cfg.sandwich_norms:
        return gemma.hf_config(cfg, torch_dtype, carried)
    if gpt_oss.is_gpt_oss(cfg):
        return gpt_oss.hf_config(cfg, torch_dtype, carried)
    rope = None
    if (s := cfg.rope_scaling) is not None:
        rope = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position}
    require(not (cfg.attention_bias or cfg.moe_biases or cfg.swiglu_limit),
            "export to Hugging Face of attention biases, expert biases or the clamped SwiGLU "
            "is supported as GptOss only (with sinks and experts); this model is not one")
    require(cfg.sliding_window is None and not cfg.attention_sinks,
            "export to Hugging Face of sliding-window or sink attention is not supported yet "
            "(Llama, Qwen3 and Mixtral files have neither); train without --sliding-window "
            "and --attention-sinks")
    require(not cfg.nope_every, "export to Hugging Face of layers without rotary embeddings "
            "is not supported (Llama, Qwen3 and Mixtral files rotate every layer); train "
            "without --nope-every")
    kind = {(False, False): "llama", (True, False): "qwen3", (False, True): "mixtral",
            (True, True): "qwen3_moe"}[cfg.qk_norm, bool(cfg.n_experts)]
    family = {"use_sliding_window": False, "sliding_window": None,
              "max_window_layers": cfg.n_layers} if cfg.qk_norm else \
        {"sliding_window": None} if cfg.n_experts else {"mlp_bias": False, "pretraining_tp": 1}
    if cfg.n_experts:
        require(cfg.gating == "softmax", "export to Hugging Face needs softmax gating (Mixtral "
                "and Qwen3-MoE route so); this model's is sigmoid")
        require(not cfg.shared_d_ff, "export to Hugging Face of a shared expert is not "
                "supported yet (Mixtral and Qwen3-MoE have none); train without --shared-d-ff")
        require(not cfg.router_bias_rate, "export to Hugging Face of routing biases is not "
                "supported (Mixtral and Qwen3-MoE have none); train without "
                "--router-bias-rate")
        require(cfg.norm_topk_prob or cfg.qk_norm, "export to Hugging Face as Mixtral needs "
                "the top-k weights renormalised, as Mixtral always does")
        experts = "num_experts" if cfg.qk_norm else "num_local_experts"
        family |= {experts: cfg.n_experts, "num_experts_per_tok": cfg.top_k,
                   "router_aux_loss_coef": cfg.aux_loss_weight, "output_router_logits": False}
        if cfg.qk_norm:  # Qwen3-MoE: every block sparse, the experts' width its own field
            family |= {"moe_intermediate_size": cfg.d_ff, "norm_topk_prob": cfg.norm_topk_prob,
                       "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim_per_head, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope,
        "max_position_embeddings": max(DEFAULT_MAX_POSITION,
                                       rope["original_max_position_embeddings"] if rope else 0),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, **family,
        "use_cache": True, "torch_dtype": torch_dtype,
        **carried,
    }
