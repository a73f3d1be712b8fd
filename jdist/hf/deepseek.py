"""DeepSeek-V3's `config.json` <-> `ModelConfig`: MLA (`models.mla`), sigmoid group-limited
routing with its correction bias (`models.routing`) and one shared expert. Tensor names and
layouts are `jdist.hf.layout`'s; dense first layers (first_k_dense_replace) are a run of
their own (`models.runs`). Fields the model cannot represent are refused in one line: yarn
rope scaling, for now."""

from __future__ import annotations

from jdist.errors import require
from jdist.models.config import ModelConfig

MODEL_TYPE, ARCHITECTURE = "deepseek_v3", "DeepseekV3ForCausalLM"
# DeepSeek-V3's bias update speed (gamma, paper section 2.1.2); HF configs do not carry it.
BIAS_RATE = 0.001


def model_config(c: dict, where: str, rope: tuple[float, dict]) -> ModelConfig:
    """The `ModelConfig` of a DeepseekV3 config.json `c` (read from `where`); `rope`:
    (rope_theta, scaling or {}) as `jdist.hf.config.rope_fields` reads them."""
    require(c.get("architectures", [ARCHITECTURE]) == [ARCHITECTURE],
            f"{where}: architectures {c.get('architectures')} with model_type {MODEL_TYPE!r}; "
            f"only {ARCHITECTURE} is supported")
    theta, scaling = rope
    require(not scaling, f"{where}: rope scaling {scaling.get('rope_type', scaling.get('type'))!r}"
            " is not supported for DeepSeek-V3 yet; use a config without rope scaling")
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
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": 4096, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "num_nextn_predict_layers": 0, "use_cache": True, "dtype": torch_dtype,
        **carried,
    }
