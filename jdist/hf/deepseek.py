"""DeepSeek-V3's `config.json` <-> `ModelConfig`: MLA (`models.mla`), sigmoid group-limited
routing with its correction bias (`models.routing`) and one shared expert. Tensor names and
layouts are `jdist.hf.layout`'s; dense first layers (first_k_dense_replace) are a run of
their own (`models.runs`). YaRN rope scaling is DeepSeek's (`models.yarn`). Fields the model
cannot represent are refused in one line."""

from __future__ import annotations

from jdist.errors import require
from jdist.hf.family import refuse_quantized, require_architecture
from jdist.models.config import ModelConfig, RopeScaling

MODEL_TYPE, ARCHITECTURE = "deepseek_v3", "DeepseekV3ForCausalLM"
# DeepSeek-V3's bias update speed (gamma, paper section 2.1.2); HF configs do not carry it.
BIAS_RATE = 0.001


def model_config(c: dict, where: str, rope: tuple[float, dict]) -> ModelConfig:
    """The `ModelConfig` of a DeepseekV3 config.json `c` (read from `where`); `rope`:
    (rope_theta, scaling or {}) as `jdist.hf.config.rope_fields` reads them."""
    require_architecture(c, where, MODEL_TYPE, ARCHITECTURE)
    theta, scaling = rope
    refuse_quantized(c, where, "the published checkpoint's FP8 blocks")
    require(not c.get("attention_bias", False) and c.get("hidden_act", "silu") == "silu",
            f"{where}: attention_bias or a hidden_act other than silu is not supported")
    require(c.get("topk_method", "noaux_tc") == "noaux_tc" and
            c.get("scoring_func", "sigmoid") == "sigmoid",
            f"{where}: only sigmoid scores with noaux_tc top-k (DeepSeek-V3's) are supported")
    nope, rope = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
    heads = int(c["num_attention_heads"])
    cfg = ModelConfig(
        vocab_size=int(c["vocab_size"]), d_model=int(c["hidden_size"]),
        n_layers=int(c["num_hidden_layers"]), n_heads=heads, n_kv_heads=heads,
        d_ff=int(c["moe_intermediate_size"]), head_dim=nope + rope, rope_theta=theta,
        first_dense_layers=int(c.get("first_k_dense_replace", 3)),
        dense_d_ff=int(c["intermediate_size"]),
        rope_scaling=yarn_scaling(scaling, where) if scaling else None,
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        n_experts=int(c["n_routed_experts"]), top_k=int(c["num_experts_per_tok"]),
        moe_routing="dropless", gating="sigmoid",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        shared_d_ff=int(c["moe_intermediate_size"]) * int(c.get("n_shared_experts") or 0),
        aux_loss_weight=0.0, z_loss_weight=0.0, router_bias_rate=BIAS_RATE,
        n_expert_groups=int(c.get("n_group") or 1), topk_groups=int(c.get("topk_group") or 1),
        routed_scale=float(c.get("routed_scaling_factor", 1.0)),
        kv_lora_rank=int(c["kv_lora_rank"]), q_lora_rank=int(c.get("q_lora_rank") or 0),
        rope_head_dim=rope, v_head_dim=int(c["v_head_dim"]),
        mtp_depth=0)  # HF's DeepseekV3ForCausalLM has no MTP module (layer 61 is skipped)
    cfg.validate()
    return cfg


def yarn_scaling(s: dict, where: str) -> RopeScaling:
    """DeepSeek-V3's YaRN rope scaling from config.json's dict; only with cos and sin left
    unscaled (HF's attention_factor 1: mscale equal to mscale_all_dim, as published)."""
    kind = s.get("rope_type", s.get("type"))
    require(kind == "yarn", f"{where}: rope scaling {kind!r} is not supported for DeepSeek-V3; "
            "only yarn (or none) is")
    mscale, all_dim = float(s.get("mscale") or 0), float(s.get("mscale_all_dim") or 0)
    require(s.get("attention_factor", 1.0 if mscale == all_dim else None) == 1.0,
            f"{where}: yarn with mscale {mscale} != mscale_all_dim {all_dim} (cos and sin "
            "scaled) is not supported; DeepSeek-V3 publishes them equal")
    return RopeScaling(factor=float(s["factor"]), rope_type="yarn",
                       original_max_position=int(s["original_max_position_embeddings"]),
                       beta_fast=float(s.get("beta_fast") or 32),
                       beta_slow=float(s.get("beta_slow") or 1), mscale_all_dim=all_dim)


def rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters of `cfg` (YaRN's, or plain)."""
    plain = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if (s := cfg.rope_scaling) is None:
        return plain
    return plain | {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast,
                    "beta_slow": s.beta_slow, "mscale": s.mscale_all_dim,
                    "mscale_all_dim": s.mscale_all_dim,
                    "original_max_position_embeddings": s.original_max_position}


def hf_config(cfg: ModelConfig, torch_dtype: str, carried: dict) -> dict:
    """config.json for a DeepSeek-V3-shaped `cfg`, as `DeepseekV3Config` writes it."""
    require(cfg.n_experts and cfg.gating == "sigmoid" and cfg.router_bias_rate > 0,
            "export as DeepseekV3 needs MoE blocks with sigmoid gating and routing biases "
            "(--router-bias-rate); this model has MLA but not DeepSeek's routing")
    require(cfg.shared_d_ff % cfg.d_ff == 0, f"export as DeepseekV3 needs the shared expert's "
            f"width {cfg.shared_d_ff} to be a multiple of the experts' {cfg.d_ff}")
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.dense_d_ff or cfg.d_ff, "moe_intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads, "n_shared_experts": cfg.shared_d_ff // cfg.d_ff,
        "n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
        "n_group": cfg.n_expert_groups, "topk_group": cfg.topk_groups,
        "routed_scaling_factor": cfg.routed_scale, "norm_topk_prob": cfg.norm_topk_prob,
        "first_k_dense_replace": cfg.first_dense_layers, "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None, "qk_rope_head_dim": cfg.rope_dim,
        "qk_nope_head_dim": cfg.dim_per_head - cfg.rope_dim, "v_head_dim": cfg.value_dim,
        "rope_interleave": True, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_parameters(cfg),
        "max_position_embeddings": 4096, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "num_nextn_predict_layers": 0, "use_cache": True, "dtype": torch_dtype,
        **carried,
    }
