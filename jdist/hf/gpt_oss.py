"""gpt-oss's `config.json` <-> `ModelConfig`: attention biases and learned sinks, sliding
(HF `layer_types`) and full layers in turn as a run of periods (`models.runs`), YaRN rope
scaling, experts with a router bias, per-expert biases and the clamped SwiGLU, softmax over
the top-k router logits (= softmax gating renormalised over the k). Tensor names and
layouts are `jdist.hf.layout`'s."""

from __future__ import annotations

from jdist.errors import require
from jdist.hf.family import refuse_quantized, require_architecture
from jdist.models import yarn
from jdist.models.config import ModelConfig, RopeScaling
from jdist.models.runs import window_of

MODEL_TYPE, ARCHITECTURE = "gpt_oss", "GptOssForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"


def full_every(types: list, where: str) -> int:
    """N of `ModelConfig.full_attention_every` for HF's `layer_types`: every N-th layer
    full, the rest sliding (0: all sliding); any other pattern is refused."""
    full = [i for i, t in enumerate(types) if t == FULL]
    every = full[0] + 1 if full else 0
    want = [FULL if every and (i + 1) % every == 0 else SLIDING for i in range(len(types))]
    require(types == want, f"{where}: layer_types {types} is not every N-th layer full "
            "attention and the rest sliding; only such patterns are supported")
    return every


def model_config(c: dict, where: str, rope: tuple[float, dict]) -> ModelConfig:
    """The `ModelConfig` of a GptOss config.json `c` (read from `where`); `rope`:
    (rope_theta, scaling or {}) as `jdist.hf.config.rope_fields` reads them."""
    require_architecture(c, where, MODEL_TYPE, ARCHITECTURE)
    theta, s = rope
    refuse_quantized(c, where, "the published checkpoint's MXFP4 experts")
    kind = s.get("rope_type", s.get("type"))
    require(not s or (kind == "yarn" and not s.get("attention_factor") and not s.get("mscale")),
            f"{where}: rope {kind!r} (or yarn with attention_factor/mscale) is not supported "
            "for gpt-oss; use yarn scaling or none")
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    scaling = None if not s else RopeScaling(
        factor=float(s["factor"]), original_max_position=int(s["original_max_position_embeddings"]),
        rope_type="yarn", beta_fast=float(s.get("beta_fast") or 32),
        beta_slow=float(s.get("beta_slow") or 1), truncate=bool(s.get("truncate", True)),
        attention_factor=yarn.default_attention_factor(float(s["factor"])))
    cfg = ModelConfig(
        vocab_size=int(c["vocab_size"]), d_model=int(c["hidden_size"]), n_layers=layers,
        n_heads=int(c["num_attention_heads"]), n_kv_heads=int(c["num_key_value_heads"]),
        d_ff=int(c["intermediate_size"]), head_dim=int(c.get("head_dim") or 64),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_window=int(c["sliding_window"]) if SLIDING in types else None,
        full_attention_every=full_every(types, where), attention_sinks=True,
        attention_bias=bool(c.get("attention_bias", True)),
        n_experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
        moe_routing="dropless", norm_topk_prob=True, moe_biases=True,
        swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        aux_loss_weight=float(c.get("router_aux_loss_coef", 0.001)), z_loss_weight=0.0)
    cfg.validate()
    return cfg


def is_gpt_oss(cfg: ModelConfig) -> bool:
    return bool(cfg.n_experts and cfg.moe_biases and cfg.attention_sinks)


def hf_config(cfg: ModelConfig, torch_dtype: str, carried: dict) -> dict:
    """config.json for a gpt-oss-shaped `cfg`, as `GptOssConfig` writes it."""
    require(cfg.gating == "softmax" and cfg.norm_topk_prob and cfg.swiglu_limit > 0
            and not cfg.shared_d_ff and not cfg.router_bias_rate and not cfg.first_dense_layers,
            "export as GptOss needs softmax top-k routing renormalised over the k, the "
            "clamped SwiGLU, and no shared expert, routing biases or dense first layers")
    s = cfg.rope_scaling
    require(s is None or s.rope_type == "yarn", "export as GptOss needs yarn rope scaling or "
            "none")
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"} if s is None else {
        "rope_theta": cfg.rope_theta, "rope_type": "yarn", "factor": s.factor,
        "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate,
        "original_max_position_embeddings": s.original_max_position}
    types = [SLIDING if window_of(cfg, i) else FULL for i in range(cfg.n_layers)]
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim_per_head, "sliding_window": cfg.sliding_window,
        "layer_types": types, "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k, "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha, "router_aux_loss_coef": cfg.aux_loss_weight,
        "attention_bias": cfg.attention_bias, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
        "max_position_embeddings": 131072, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0, "initializer_range": 0.02, "output_router_logits": False,
        "use_cache": True, "dtype": torch_dtype, **carried,
    }
