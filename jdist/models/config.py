"""Model shapes: `ModelConfig` and the named presets.

Presets: `tiny`, `small`, `qlora-tiny` (byte vocabulary, runnable on a CPU; `qlora-tiny` has
head_dim 64, so its projections hold whole NF4 blocks for `--quantize-base nf4`); `moe-tiny`,
`moe-small`, `8x7b` (mixture of experts); `dense-moe-tiny` (dense blocks, then experts);
`deepseek-tiny` (MLA, DeepSeek routing, MTP); shape-only `deepseek-v3`, `gpt-oss-20b`,
`gpt-oss-120b`, `gemma3-1b`,
`gemma3-27b` (text); and shape-only ones
with the public Llama shapes
(HF config.json): `llama2-7b`, `llama3-8b`, `llama3.1-8b`, `llama3.1-70b`, `llama3.2-1b`,
`llama3.2-3b`.
Aliases: `1b` = `llama3.2-1b`, `7b` = `llama2-7b`, `70b` = `llama3.1-70b`.
"""

from __future__ import annotations

import dataclasses
import math

from jdist.errors import require
from jdist.models.lora import LoraConfig, lora_from_dict


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: Llama 3.x's (HF `rope_scaling` with rope_type "llama3"), or
    YaRN's (rope_type "yarn", DeepSeek-V3's; `models.yarn`), or linear (every frequency
    divided by `factor`; Gemma 3's global layers).

    llama3: frequencies whose wavelength exceeds original_max_position / low_freq_factor are
    divided by `factor`; those with a wavelength under original_max_position /
    high_freq_factor are kept; the ones in between are blended smoothly.
    """
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192  # HF original_max_position_embeddings
    rope_type: str = "llama3"
    # YaRN: the ramp between kept and interpolated frequencies (in rotations), and the
    # softmax scale's factor (0.1 x mscale_all_dim x ln(factor) + 1, squared; 0: none).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale_all_dim: float = 0.0
    # YaRN's gain on cos and sin (HF's attention_factor; gpt-oss: 0.1 ln(factor) + 1, its
    # default when no mscale is given; 1: none, as DeepSeek-V3's mscale = mscale_all_dim),
    # and whether the ramp's ends are rounded to whole dimensions (gpt-oss: false).
    attention_factor: float = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int = 0  # 0: d_model // n_heads
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    # Each query sees only its last `sliding_window` keys, itself included (HF's field;
    # None: all earlier keys). Attention kernels take it per call (`jdist.parallel.attention`).
    sliding_window: int | None = None
    # A learned logit per head in every softmax denominator, with no value (gpt-oss `sinks`).
    attention_sinks: bool = False
    # With sliding_window: every N-th layer attends to all keys, the others to the window
    # (gpt-oss: 2, Gemma 3: 6; HF's layer_types / sliding_window_pattern); 0: all windowed.
    full_attention_every: int = 0
    # Gemma 3's differences from Llama, each off by default. RMSNorm scales by (1 + weight),
    # the weight starting at 0 (`norm_plus_one`); each block also normalises its attention's
    # and its MLP's output before adding them to the residual stream (`sandwich_norms`); the
    # gated MLP's activation (`mlp_activation`: silu, or gelu_tanh); the embedded tokens are
    # scaled by sqrt(d_model) (`embed_scale`); scores scaled by query_pre_attn_scalar**-0.5
    # instead of head_dim**-0.5 (0: head_dim); the sliding-window layers' own rope base
    # (`rope_local_theta`, 0: rope_theta).
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float = 0.0
    rope_local_theta: float = 0.0
    # Every N-th layer attends without rotary embeddings (Llama 4's and SmolLM3's NoPE
    # layers: 4); 0: every layer rotates.
    nope_every: int = 0
    # Biases on the q, k, v and output projections (gpt-oss's attention_bias).
    attention_bias: bool = False
    shape_only: bool = False  # too big to allocate on a CPU: planning and AOT compiles only
    # Mixture of experts (n_experts = 0: dense SwiGLU MLP in every block).
    n_experts: int = 0
    top_k: int = 2
    moe_routing: str = "dropless"  # or "grouped" (dropless at the routed FLOPs), "capacity"
    capacity_factor: float = 1.25
    gating: str = "softmax"        # or "sigmoid"
    norm_topk_prob: bool = True    # the chosen k weights renormalised to sum to one
    # A shared expert every token passes through beside the routed ones (DeepSeek's
    # n_shared x moe_intermediate_size as one SwiGLU; Qwen2-MoE's shared_expert), 0: none;
    # with shared_gate its output is scaled by sigmoid(x @ w) (Qwen2-MoE).
    shared_d_ff: int = 0
    shared_gate: bool = False
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    # DeepSeek-V3's auxiliary-loss-free balancing (0: off): a per-layer, per-expert bias on
    # the routing scores, for the choice of experts only, moved by this much after every
    # step toward an even load (`models.moe.rebalanced_bias`); never trained.
    router_bias_rate: float = 0.0
    # DeepSeek-V3's group-limited routing (models.routing): the experts fall in
    # n_expert_groups equal groups; a token chooses among the experts of its topk_groups
    # best groups only (a group scored by its two best experts). 1: no groups.
    n_expert_groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0      # the chosen weights times this (routed_scaling_factor)
    # gpt-oss's experts: a learned router bias on the logits, and every expert's biases on
    # its gate, up and down projections (the down bias weighted by the router like the rest).
    moe_biases: bool = False
    # gpt-oss's clamped SwiGLU in the experts (0: plain silu(gate) * up): gate clamped
    # above and up on both sides at this limit, then (up + 1) * gate * sigmoid(alpha gate).
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # Multi-head latent attention (models.mla; kv_lora_rank 0: plain attention). Keys and
    # values come up from a kv_lora_rank latent; queries from a q_lora_rank one (0: straight
    # from the residual stream). Of each q/k head's head_dim, the last rope_head_dim carry
    # rotary embeddings (a key rope part shared by all heads); values have v_head_dim.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek-V3's multi-token prediction (models.mtp; 0: off): one more block predicts the
    # token after next from the last hidden state and the next token's embedding; its
    # cross-entropy, times mtp_weight, joins the objective.
    mtp_depth: int = 0
    mtp_weight: float = 0.3
    # LoRA adapters on the projections (models.lora); None: none.
    lora: LoraConfig | None = None
    # A heterogeneous stack (DeepSeek's first_k_dense_replace): the first blocks of a mixture
    # of experts keep a dense SwiGLU MLP, `dense_d_ff` wide (0: d_ff). The stack becomes
    # runs of equal blocks, each its own scanned stack (`models.runs`).
    first_dense_layers: int = 0
    dense_d_ff: int = 0

    @property
    def moe_layers(self) -> int:
        """How many blocks route to experts (the rows of the per-layer balance tables)."""
        return self.n_layers - self.first_dense_layers if self.n_experts else 0

    @property
    def dim_per_head(self) -> int:
        """Of queries and keys (with MLA, their no-rope part plus `rope_head_dim`)."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head that rotary embeddings turn."""
        return self.rope_head_dim if self.kv_lora_rank else self.dim_per_head

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.kv_lora_rank else self.dim_per_head

    def attention_matmuls(self) -> int:
        """One layer's attention weights that multiply activations (q, k, v, output; MLA's
        down and up projections)."""
        d, h, hd = self.d_model, self.n_heads, self.dim_per_head
        if not self.kv_lora_rank:
            return d * hd * (2 * h + 2 * self.n_kv_heads)
        r, rq = self.kv_lora_rank, self.q_lora_rank
        q = rq * (d + h * hd) if rq else d * h * hd
        kv = d * (r + self.rope_dim) + r * h * (hd - self.rope_dim + self.value_dim)
        return q + kv + h * self.value_dim * d

    def attention_params(self) -> int:
        """`attention_matmuls`, with the norms' scales (Qwen3's q/k, MLA's latents) and
        the sinks and biases."""
        norms = self.kv_lora_rank + self.q_lora_rank if self.kv_lora_rank else \
            2 * self.dim_per_head * self.qk_norm
        biases = self.attention_bias * (
            (self.n_heads + 2 * self.n_kv_heads) * self.dim_per_head + self.d_model)
        return self.attention_matmuls() + norms + self.n_heads * self.attention_sinks + biases

    def block_params(self, moe: bool) -> int:
        """One block's parameters: routed (with any shared expert) or dense."""
        d, norms = self.d_model, (4 if self.sandwich_norms else 2) * self.d_model
        if not moe:
            return self.attention_params() + 3 * d * (self.dense_d_ff or self.d_ff) + norms
        shared = 3 * d * self.shared_d_ff + d * self.shared_gate
        router = (d + (self.router_bias_rate > 0) + self.moe_biases) * self.n_experts
        router += self.moe_biases * self.n_experts * (2 * self.d_ff + d)  # experts' biases
        return self.attention_params() + 3 * d * self.d_ff * self.n_experts + router + shared \
            + norms

    def n_params(self) -> int:
        """Parameter count, from the shapes alone."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        # The MTP module: two input norms, the [2d, d] projection, a dense block, its norm.
        mtp = self.mtp_depth * (3 * self.d_model + 2 * self.d_model ** 2 + self.block_params(False))
        blocks = self.moe_layers * self.block_params(True) + \
            (self.n_layers - self.moe_layers) * self.block_params(False)
        return blocks + mtp + self.vocab_size * self.d_model + head + self.d_model

    def validate(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            require(getattr(self, field) > 0, f"--{field.replace('_', '-')} must be positive")
        require(self.n_heads % self.n_kv_heads == 0,
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention needs each kv head to serve a whole group of heads")
        require(self.head_dim > 0 or self.d_model % self.n_heads == 0,
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change --d-model or --n-heads")
        if self.n_experts:
            require(1 <= self.top_k <= self.n_experts,
                    f"--top-k {self.top_k} must be between 1 and --n-experts {self.n_experts}")
            require(self.moe_routing in ("dropless", "grouped", "capacity"),
                    f"unknown --moe-routing {self.moe_routing!r}; use dropless, grouped or "
                    "capacity")
            require(self.capacity_factor > 0,
                    f"--capacity-factor {self.capacity_factor} must be positive")
            require(self.gating in ("softmax", "sigmoid"),
                    f"unknown gating {self.gating!r}; use softmax or sigmoid")
            require(self.router_bias_rate >= 0,
                    f"--router-bias-rate {self.router_bias_rate} must be 0 (off) or positive")
            require(self.shared_d_ff >= 0, f"--shared-d-ff {self.shared_d_ff} must be 0 (no "
                    "shared expert) or positive")
            require(0 <= self.first_dense_layers < self.n_layers,
                    f"--first-dense-layers {self.first_dense_layers} must leave at least one "
                    f"of the {self.n_layers} layers to the experts")
            validate_routing(self)
            require(self.moe_routing != "grouped" or not (self.moe_biases or self.swiglu_limit),
                    "--moe-routing grouped has no expert biases or clamped SwiGLU (gpt-oss's) "
                    "yet; use --moe-routing dropless or capacity")
            require(self.swiglu_limit >= 0, f"swiglu_limit {self.swiglu_limit} must be 0 "
                    "(plain SwiGLU) or positive")
        else:
            require(not self.moe_biases and not self.swiglu_limit, "expert biases and the "
                    "clamped SwiGLU belong to a mixture of experts; add --n-experts E")
            require(not self.first_dense_layers and not self.dense_d_ff,
                    "--first-dense-layers and --dense-d-ff keep the first blocks of a mixture "
                    "of experts dense; add --n-experts E")
            require(not self.router_bias_rate,
                    "--router-bias-rate balances a mixture of experts; add --n-experts E")
            require(not self.shared_d_ff and not self.shared_gate,
                    "--shared-d-ff and --shared-gate add a shared expert to a mixture of "
                    "experts; add --n-experts E")
        require(not self.shared_gate or self.shared_d_ff > 0,
                "--shared-gate scales a shared expert; give it --shared-d-ff F")
        require(self.lora is None or not self.router_bias_rate,
                "LoRA freezes the router, so there is no routing to rebalance; drop "
                "--router-bias-rate")
        require(self.dense_d_ff >= 0, f"--dense-d-ff {self.dense_d_ff} must be 0 (--d-ff) or "
                "positive")
        if self.lora is not None:  # with experts, MLP adapters go on the shared expert only
            mlp = self.shared_d_ff if self.n_experts else self.d_ff
            dims = (self.d_model, self.dim_per_head * self.n_kv_heads) + ((mlp,) if mlp else ())
            self.lora.validate(min(dims), moe=bool(self.n_experts) and not self.shared_d_ff)
        if self.kv_lora_rank:
            validate_mla(self)
        require(self.mtp_depth in (0, 1), f"--mtp-depth {self.mtp_depth}: one module (1) or "
                "none (0) is supported")
        require(self.mtp_weight >= 0, f"--mtp-weight {self.mtp_weight} must not be negative")
        require(self.rope_dim % 2 == 0,
                f"rotary dimension {self.rope_dim} is odd; rotary embeddings need an even one")
        require(self.full_attention_every >= 0 and (
            not self.full_attention_every or self.sliding_window is not None),
            f"--full-attention-every {self.full_attention_every} alternates full attention "
            "with a sliding window: give --sliding-window N too (0: every layer windowed)")
        require(self.nope_every >= 0, f"--nope-every {self.nope_every} must be 0 (rotary "
                "embeddings in every layer) or positive")
        require(self.sliding_window is None or self.sliding_window >= 1,
                f"--sliding-window {self.sliding_window} must be at least 1 (one key: the "
                "query's own); leave it out for full attention")
        require(self.rope_theta > 1, f"rope_theta={self.rope_theta} must be greater than 1")
        validate_gemma(self)
        if (rs := self.rope_scaling) is not None:
            require(rs.rope_type in ("llama3", "yarn", "linear"), f"rope scaling type "
                    f"{rs.rope_type!r}: use llama3, yarn or linear")
            require(rs.rope_type == "llama3" or self.kv_lora_rank or not rs.mscale_all_dim,
                    "yarn's mscale_all_dim (a softmax scale) is supported with multi-head "
                    "latent attention (DeepSeek) only")
            require(rs.factor >= 1, f"rope scaling factor={rs.factor} must be at least 1")
            require(rs.low_freq_factor > 0,
                    f"rope low_freq_factor={rs.low_freq_factor} must be positive")
            require(rs.high_freq_factor > rs.low_freq_factor,
                    f"rope high_freq_factor={rs.high_freq_factor} must exceed "
                    f"low_freq_factor={rs.low_freq_factor}")
            require(rs.original_max_position > 0,
                    f"rope original_max_position={rs.original_max_position} must be positive")


def validate_routing(cfg: ModelConfig) -> None:
    e, g, kg = cfg.n_experts, cfg.n_expert_groups, cfg.topk_groups
    require(g >= 1 and e % g == 0, f"--n-expert-groups {g} must divide --n-experts {e}")
    require(g == 1 or e // g >= 2, f"{e} experts in {g} groups leave fewer than 2 per group; "
            "a group is scored by its two best experts: use fewer --n-expert-groups")
    require(1 <= kg <= g, f"--topk-groups {kg} must be between 1 and --n-expert-groups {g}")
    require(cfg.top_k <= kg * e // g, f"--top-k {cfg.top_k} is more than the {kg * e // g} "
            f"experts of {kg} groups; raise --topk-groups")
    require(cfg.routed_scale > 0, f"--routed-scale {cfg.routed_scale} must be positive")


def validate_gemma(cfg: ModelConfig) -> None:
    require(cfg.mlp_activation in ("silu", "gelu_tanh"), f"unknown MLP activation "
            f"{cfg.mlp_activation!r}; use silu or gelu_tanh")
    require(cfg.mlp_activation == "silu" or not cfg.n_experts, "experts run SwiGLU (silu) "
            f"only; a mixture of experts cannot take the {cfg.mlp_activation} activation")
    require(cfg.query_pre_attn_scalar >= 0, f"query_pre_attn_scalar "
            f"{cfg.query_pre_attn_scalar} must be 0 (head_dim) or positive")
    require(cfg.rope_local_theta == 0 or (cfg.rope_local_theta > 1 and cfg.sliding_window),
            f"rope_local_theta {cfg.rope_local_theta} is the rope base of sliding-window "
            "layers: give a value above 1 and --sliding-window N, or 0")
    require(not cfg.kv_lora_rank or not (cfg.norm_plus_one or cfg.sandwich_norms or
                                         cfg.query_pre_attn_scalar or cfg.rope_local_theta),
            "MLA takes none of Gemma 3's norms, query scale or local rope base; drop them")


def validate_mla(cfg: ModelConfig) -> None:
    hd, rope = cfg.dim_per_head, cfg.rope_head_dim
    require(0 < rope < hd, f"MLA's rope_head_dim {rope} must be positive and below the q/k "
            f"head_dim {hd} (the no-rope part plus the rope part)")
    require(0 < cfg.v_head_dim <= hd, f"MLA's v_head_dim {cfg.v_head_dim} must be positive and "
            f"at most head_dim {hd}: values are padded to the q/k head width for the kernels")
    require(cfg.n_kv_heads == cfg.n_heads, f"MLA gives every head its own key and value: "
            f"set n_kv_heads = n_heads ({cfg.n_heads})")
    require(cfg.q_lora_rank >= 0, f"q_lora_rank {cfg.q_lora_rank} must be 0 (no query "
            "latent) or positive")
    require(not cfg.qk_norm and cfg.lora is None, "MLA takes neither --qk-norm nor LoRA "
            "adapters; drop them")
    require(not cfg.nope_every, "MLA's rotary part is its own (rope_head_dim); drop "
            "--nope-every")
    require(cfg.sliding_window is None and not cfg.attention_sinks, "MLA takes no "
            "--sliding-window or --attention-sinks yet (DeepSeek-V3 has neither); drop them")


BYTE_VOCAB = 256

_LLAMA3_8B = ModelConfig(vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         d_ff=14_336, rope_theta=500_000.0, shape_only=True)

# DeepSeek-V3's routing and objective: sigmoid scores, weights renormalised then scaled by
# 2.5, aux-loss-free balancing (gamma 0.001) beside a small balance loss (alpha 1e-4), no
# z-loss, one MTP module weighted 0.3.
_DEEPSEEK = dict(gating="sigmoid", routed_scale=2.5, router_bias_rate=0.001,
                 aux_loss_weight=1e-4, z_loss_weight=0.0, mtp_depth=1, mtp_weight=0.3)

_GPT_OSS = ModelConfig(vocab_size=201_088, d_model=2880, n_layers=24, n_heads=64,
                       n_kv_heads=8, d_ff=2880, head_dim=64, rope_theta=150_000.0,
                       rope_scaling=RopeScaling(factor=32.0, original_max_position=4096,
                                                rope_type="yarn", truncate=False,
                                                attention_factor=0.1 * math.log(32.0) + 1),
                       sliding_window=128, full_attention_every=2, attention_sinks=True,
                       attention_bias=True, n_experts=32, top_k=4, moe_biases=True,
                       swiglu_limit=7.0, aux_loss_weight=0.001, z_loss_weight=0.0,
                       shape_only=True)
# Gemma 3's decoder: (1 + weight) norms, four per block, q/k norms, GELU-tanh, scaled
# embeddings, tied; every 6th layer global (rope base 1e6), the others local (1e4).
_GEMMA3 = dict(norm_eps=1e-6, tie_embeddings=True, qk_norm=True, full_attention_every=6,
               norm_plus_one=True, sandwich_norms=True, mlp_activation="gelu_tanh",
               embed_scale=True, rope_theta=1_000_000.0, rope_local_theta=10_000.0)

PRESETS: dict[str, ModelConfig] = {
    # Unit tests: compiles in seconds; every dimension divides 8 ways.
    "tiny": ModelConfig(vocab_size=BYTE_VOCAB, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4,
                        d_ff=128),
    # CPU demo: ~3.3M parameters, learns visible structure of Python source in minutes.
    "small": ModelConfig(vocab_size=BYTE_VOCAB, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                         d_ff=768),
    # QLoRA on a CPU: NF4 stores blocks of 64 weights along each projection's last dimension
    # (head_dim, d_model, d_ff), whole blocks in every shard up to fsdp=2,tp=2; tiny's
    # head_dim of 8 holds none.
    "qlora-tiny": ModelConfig(vocab_size=BYTE_VOCAB, d_model=128, n_layers=2, n_heads=2,
                              n_kv_heads=2, d_ff=256),
    # Mixtral-style: every block's MLP is a top-2 mixture of experts.
    "moe-tiny": ModelConfig(vocab_size=BYTE_VOCAB, d_model=64, n_layers=2, n_heads=8,
                            n_kv_heads=4, d_ff=64, n_experts=8, top_k=2),
    # DeepSeek-style heterogeneous stack: a dense first block, then a mixture of experts
    # (two runs, `models.runs`).
    "dense-moe-tiny": ModelConfig(vocab_size=BYTE_VOCAB, d_model=64, n_layers=4, n_heads=8,
                                  n_kv_heads=4, d_ff=64, n_experts=8, top_k=2,
                                  first_dense_layers=2, dense_d_ff=128),
    # DeepSeek-V3 in small: a dense first block, then MoE; MLA (q/k heads of 8 no-rope + 8
    # rope dims, values of 8, padded for the kernels); sigmoid routing over 4 groups of 2
    # experts (2 groups kept), scaled by 2.5, with routing biases and a shared expert; MTP.
    "deepseek-tiny": ModelConfig(vocab_size=BYTE_VOCAB, d_model=64, n_layers=2, n_heads=8,
                                 n_kv_heads=8, d_ff=32, head_dim=16, n_experts=8, top_k=2,
                                 first_dense_layers=1, dense_d_ff=128, **_DEEPSEEK,
                                 n_expert_groups=4, topk_groups=2, shared_d_ff=32,
                                 kv_lora_rank=16, q_lora_rank=32, rope_head_dim=8,
                                 v_head_dim=8),
    "moe-small": ModelConfig(vocab_size=BYTE_VOCAB, d_model=256, n_layers=4, n_heads=8,
                             n_kv_heads=4, d_ff=384, n_experts=8, top_k=2),
    # Public MoE shapes (HF config.json), for planning only: Mixtral (8 experts, top-2) and
    # Qwen3-MoE (128 fine-grained experts, top-8; d_ff is moe_intermediate_size).
    "mixtral-8x7b": ModelConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, d_ff=14_336, rope_theta=1_000_000.0, n_experts=8,
                                top_k=2, shape_only=True),
    # The 128- and 256-expert presets plan with grouped routing: padded dropless would run
    # E/k times the routed FLOPs (16x here, 32x for DeepSeek-V3); `--moe-routing` overrides.
    "qwen3-30b-a3b": ModelConfig(vocab_size=151_936, d_model=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, d_ff=768, head_dim=128, rope_theta=1_000_000.0,
                                 norm_eps=1e-6, qk_norm=True, n_experts=128, top_k=8,
                                 moe_routing="grouped", shape_only=True),
    "qwen3-235b-a22b": ModelConfig(vocab_size=151_936, d_model=4096, n_layers=94, n_heads=64,
                                   n_kv_heads=4, d_ff=1536, head_dim=128,
                                   rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True,
                                   n_experts=128, top_k=8, moe_routing="grouped",
                                   shape_only=True),
    # DeepSeek-V3's published shape (HF config.json, 671B; its MTP module here is a dense
    # block, where the published one routes to experts), for planning only.
    "deepseek-v3": ModelConfig(vocab_size=129_280, d_model=7168, n_layers=61, n_heads=128,
                               n_kv_heads=128, d_ff=2048, head_dim=192, norm_eps=1e-6,
                               n_experts=256, top_k=8, first_dense_layers=3,
                               moe_routing="grouped",
                               dense_d_ff=18_432, **_DEEPSEEK, n_expert_groups=8,
                               topk_groups=4, shared_d_ff=2048, kv_lora_rank=512,
                               q_lora_rank=1536, rope_head_dim=64, v_head_dim=128,
                               rope_scaling=RopeScaling(factor=40.0, rope_type="yarn",
                                                        original_max_position=4096,
                                                        mscale_all_dim=1.0),
                               shape_only=True),
    # gpt-oss's published shapes (HF config.json), for planning only: sliding (128) and
    # full layers in turn with sinks and q/k/v/o biases, YaRN (32x over 4096), experts with
    # biases and the clamped SwiGLU, top-4 renormalised.
    "gpt-oss-20b": dataclasses.replace(_GPT_OSS, n_layers=24, n_experts=32),
    "gpt-oss-120b": dataclasses.replace(_GPT_OSS, n_layers=36, n_experts=128),
    # Gemma 3's published text shapes (HF config.json: gemma-3-1b, gemma-3-27b's
    # text_config), for planning only: five sliding-window layers to one global
    # (`runs`: periods of 6, then the 26th or the 61st and 62nd layers on their own).
    "gemma3-1b": ModelConfig(vocab_size=262_144, d_model=1152, n_layers=26, n_heads=4,
                             n_kv_heads=1, d_ff=6912, head_dim=256, sliding_window=512,
                             query_pre_attn_scalar=256, **_GEMMA3, shape_only=True),
    "gemma3-27b": ModelConfig(vocab_size=262_208, d_model=5376, n_layers=62, n_heads=32,
                              n_kv_heads=16, d_ff=21_504, head_dim=128, sliding_window=1024,
                              query_pre_attn_scalar=168, **_GEMMA3, shape_only=True,
                              rope_scaling=RopeScaling(factor=8.0, rope_type="linear")),
    # Public Llama shapes (HF config.json), for planning only. HF's head_dim (64 for
    # llama3.2-1b, 128 for the rest) is d_model // n_heads, so it is left to the default.
    "llama2-7b": ModelConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32,
                             n_kv_heads=32, d_ff=11_008, shape_only=True),
    "llama3-8b": _LLAMA3_8B,
    "llama3.1-8b": dataclasses.replace(_LLAMA3_8B, rope_scaling=RopeScaling(factor=8.0)),
    "llama3.1-70b": ModelConfig(vocab_size=128_256, d_model=8192, n_layers=80, n_heads=64,
                                n_kv_heads=8, d_ff=28_672, rope_theta=500_000.0,
                                rope_scaling=RopeScaling(factor=8.0), shape_only=True),
    "llama3.2-1b": ModelConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32,
                               n_kv_heads=8, d_ff=8192, rope_theta=500_000.0,
                               rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
                               shape_only=True),
    "llama3.2-3b": ModelConfig(vocab_size=128_256, d_model=3072, n_layers=28, n_heads=24,
                               n_kv_heads=8, d_ff=8192, rope_theta=500_000.0,
                               rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
                               shape_only=True),
    # Public Qwen3 dense shapes (HF config.json), for planning only: Llama's decoder with
    # RMSNorm on each query and key head, head_dim 128 whatever d_model / n_heads is.
    "qwen3-0.6b": ModelConfig(vocab_size=151_936, d_model=1024, n_layers=28, n_heads=16,
                              n_kv_heads=8, d_ff=3072, head_dim=128, rope_theta=1_000_000.0,
                              norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
                              shape_only=True),
    "qwen3-8b": ModelConfig(vocab_size=151_936, d_model=4096, n_layers=36, n_heads=32,
                            n_kv_heads=8, d_ff=12_288, head_dim=128, rope_theta=1_000_000.0,
                            norm_eps=1e-6, qk_norm=True, shape_only=True),
    "qwen3-32b": ModelConfig(vocab_size=151_936, d_model=5120, n_layers=64, n_heads=64,
                             n_kv_heads=8, d_ff=25_600, head_dim=128, rope_theta=1_000_000.0,
                             norm_eps=1e-6, qk_norm=True, shape_only=True),
}


def config_from_dict(fields: dict) -> ModelConfig:
    """A `ModelConfig` from `dataclasses.asdict` of one (as checkpoint metadata stores it)."""
    scaling = fields.get("rope_scaling")
    return ModelConfig(**{**fields, "rope_scaling": RopeScaling(**scaling) if scaling else None,
                          "lora": lora_from_dict(fields.get("lora"))})


# Older short names, kept for scripts and tests that use them.
ALIASES: dict[str, str] = {"1b": "llama3.2-1b", "7b": "llama2-7b", "70b": "llama3.1-70b",
                           "8x7b": "mixtral-8x7b"}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset (or alias) by name, with optional shape overrides (None values are ignored)."""
    name = ALIASES.get(name, name)
    aliases = ", ".join(f"{a} ({t})" for a, t in ALIASES.items())
    require(name in PRESETS,
            f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}; aliases: {aliases}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    config = dataclasses.replace(PRESETS[name], **changes)
    config.validate()
    return config
