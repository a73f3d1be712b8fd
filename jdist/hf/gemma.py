"""Gemma 3's (text) `config.json` <-> `ModelConfig`: Llama's decoder with (1 + weight)
RMSNorms, four of them per block, q/k norms, a GELU-tanh gated MLP, embeddings scaled by
sqrt(hidden_size), scores by query_pre_attn_scalar**-0.5, and sliding-window layers with
their own rope base, every N-th layer global (`layer_types`: a run of periods,
`models.runs`). Tensor names are `jdist.hf.layout`'s. Fields the model cannot represent are
refused in one line: rope scaling other than linear on the global layers, logit
soft-capping, bidirectional attention."""

from __future__ import annotations

from jdist.errors import require
from jdist.hf.family import require_architecture
from jdist.models.config import ModelConfig, RopeScaling
from jdist.models.runs import window_of

MODEL_TYPE, ARCHITECTURE = "gemma3_text", "Gemma3ForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATION = "gelu_pytorch_tanh"  # HF's name of jax.nn.gelu(approximate=True)
DEFAULT_PATTERN, DEFAULT_LOCAL_THETA, DEFAULT_THETA = 6, 10_000.0, 1_000_000.0


def _pattern(c: dict, where: str) -> int:
    """full_attention_every N from `layer_types` (or transformers' older
    `sliding_window_pattern`): layer i global iff (i + 1) % N == 0; 0: every layer local."""
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types") or [
        FULL if (i + 1) % int(c.get("sliding_window_pattern", DEFAULT_PATTERN)) == 0 else SLIDING
        for i in range(n)]
    every = types.index(FULL) + 1 if FULL in types else 0
    expect = [FULL if every and (i + 1) % every == 0 else SLIDING for i in range(n)]
    require(types == expect, f"{where}: layer_types {types} is not a repeating pattern of "
            "sliding layers with every N-th one full; only such patterns are supported")
    return every


def _rope(c: dict, where: str) -> tuple[float, float, RopeScaling | None]:
    """(global base, local base, the global layers' scaling) from `rope_parameters` per
    layer type (transformers 5) or `rope_theta` / `rope_local_base_freq` / `rope_scaling`
    (the hub's files). Gemma 3 scales the global layers' frequencies linearly (4B and up)."""
    params = c.get("rope_parameters") or {}
    full = params.get(FULL) or c.get("rope_scaling") or {}
    local = params.get(SLIDING, {})
    kind = lambda p: p.get("rope_type", p.get("type", "default"))
    require(kind(local) == "default" and kind(full) in ("default", "linear"),
            f"{where}: rope scaling {kind(full)!r} (full layers), {kind(local)!r} (sliding) "
            "is not supported for Gemma 3; only linear scaling of the full layers is")
    scaling = RopeScaling(factor=float(full["factor"]), rope_type="linear") \
        if kind(full) == "linear" else None
    return (float(full.get("rope_theta", c.get("rope_theta", DEFAULT_THETA))),
            float(local.get("rope_theta", c.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))),
            scaling)


def model_config(c: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a Gemma3ForCausalLM config.json `c` (read from `where`)."""
    require_architecture(c, where, MODEL_TYPE, ARCHITECTURE, " (text)")
    act = c.get("hidden_activation") or c.get("hidden_act") or ACTIVATION
    require(act == ACTIVATION, f"{where}: hidden_activation {act!r} is not supported; "
            f"Gemma 3's is {ACTIVATION}")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        require(c.get(field) is None, f"{where}: {field}={c.get(field)} is not supported "
                "(Gemma 3 sets none); use a config without it")
    require(not c.get("attention_bias") and not c.get("use_bidirectional_attention"),
            f"{where}: attention_bias or use_bidirectional_attention is not supported")
    theta, local, scaling = _rope(c, where)
    heads, d = int(c["num_attention_heads"]), int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or 256)
    cfg = ModelConfig(
        vocab_size=int(c["vocab_size"]), d_model=d, n_layers=int(c["num_hidden_layers"]),
        n_heads=heads, n_kv_heads=int(c.get("num_key_value_heads") or heads),
        d_ff=int(c["intermediate_size"]), head_dim=0 if head_dim * heads == d else head_dim,
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)), qk_norm=True,
        sliding_window=int(c["sliding_window"]), full_attention_every=_pattern(c, where),
        norm_plus_one=True, sandwich_norms=True, mlp_activation="gelu_tanh",
        embed_scale=True, query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
        rope_local_theta=local)
    cfg.validate()
    return cfg


def _number(x: float) -> int | float:
    """As HF writes it: an int when whole."""
    return int(x) if x == int(x) else x


def hf_config(cfg: ModelConfig, torch_dtype: str, carried: dict) -> dict:
    """config.json for a Gemma-3-shaped `cfg`, as `Gemma3TextConfig` writes it."""
    gemma = (cfg.norm_plus_one, cfg.qk_norm, cfg.mlp_activation, cfg.embed_scale,
             cfg.sliding_window is not None, cfg.n_experts, cfg.attention_sinks)
    require(gemma == (True, True, "gelu_tanh", True, True, 0, False),
            "export as Gemma3ForCausalLM needs all of Gemma 3's pieces (plus-one norms, q/k "
            "norms, gelu_tanh, scaled embeddings, a sliding window) and no experts or sinks")
    types = [SLIDING if window_of(cfg, i) else FULL for i in range(cfg.n_layers)]
    local = cfg.rope_local_theta or cfg.rope_theta
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if (s := cfg.rope_scaling) is not None:
        require(s.rope_type == "linear", f"export as Gemma3ForCausalLM takes linear rope "
                f"scaling only, not {s.rope_type!r}")
        full |= {"rope_type": "linear", "factor": s.factor}
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim_per_head, "hidden_activation": ACTIVATION,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or cfg.dim_per_head),
        "sliding_window": cfg.sliding_window, "layer_types": types,
        "rope_parameters": {FULL: full,
                            SLIDING: {"rope_type": "default", "rope_theta": local}},
        "max_position_embeddings": 131_072, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "use_bidirectional_attention": False,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True, "dtype": torch_dtype, **carried,
    }
