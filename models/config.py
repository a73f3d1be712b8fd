"""Model shapes: `ModelConfig` and the named presets (`tiny`, `small`, `1b`, `7b`, `70b`)."""

from __future__ import annotations

import dataclasses

from jdist.errors import require


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
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    shape_only: bool = False  # too big to allocate on a CPU: planning and AOT compiles only
    # Mixture of experts (n_experts = 0: dense SwiGLU MLP in every block).
    n_experts: int = 0
    top_k: int = 2
    moe_routing: str = "dropless"  # or "capacity"
    capacity_factor: float = 1.25
    gating: str = "softmax"        # or "sigmoid"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def n_params(self) -> int:
        """Parameter count, from the shapes alone."""
        hd = self.dim_per_head
        attn = self.d_model * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.d_model * self.d_ff * max(1, self.n_experts)
        block = attn + mlp + self.d_model * self.n_experts + 2 * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.n_layers * block + self.vocab_size * self.d_model + head + self.d_model

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
            require(self.moe_routing in ("dropless", "capacity"),
                    f"unknown --moe-routing {self.moe_routing!r}; use dropless or capacity")
            require(self.capacity_factor > 0,
                    f"--capacity-factor {self.capacity_factor} must be positive")
            require(self.gating in ("softmax", "sigmoid"),
                    f"unknown gating {self.gating!r}; use softmax or sigmoid")
        require(self.dim_per_head % 2 == 0,
                f"head dimension {self.dim_per_head} is odd; rotary embeddings need an even one")


BYTE_VOCAB = 256

PRESETS: dict[str, ModelConfig] = {
    # Unit tests: compiles in seconds; every dimension divides 8 ways.
    "tiny": ModelConfig(vocab_size=BYTE_VOCAB, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4,
                        d_ff=128),
    # CPU demo: ~3.3M parameters, learns visible structure of Python source in minutes.
    "small": ModelConfig(vocab_size=BYTE_VOCAB, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                         d_ff=768),
    # Public Llama shapes, for planning only.
    "1b": ModelConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      d_ff=8192, rope_theta=500_000.0, tie_embeddings=True, shape_only=True),
    "7b": ModelConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      d_ff=11_008, shape_only=True),
    # Mixtral-style: every block's MLP is a top-2 mixture of experts.
    "moe-tiny": ModelConfig(vocab_size=BYTE_VOCAB, d_model=64, n_layers=2, n_heads=8,
                            n_kv_heads=4, d_ff=64, n_experts=8, top_k=2),
    "moe-small": ModelConfig(vocab_size=BYTE_VOCAB, d_model=256, n_layers=4, n_heads=8,
                             n_kv_heads=4, d_ff=384, n_experts=8, top_k=2),
    "8x7b": ModelConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        d_ff=14_336, rope_theta=1_000_000.0, n_experts=8, top_k=2,
                        shape_only=True),
    "70b": ModelConfig(vocab_size=128_256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       d_ff=28_672, rope_theta=500_000.0, shape_only=True),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with optional shape overrides (None values are ignored)."""
    require(name in PRESETS, f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    config = dataclasses.replace(PRESETS[name], **changes)
    config.validate()
    return config
