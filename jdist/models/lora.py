"""LoRA: a frozen weight W plus a learned low-rank update, y = x·W + (alpha/r)·(x·A)·B.

A projection's adapter holds A [*input dims, rank] and B [rank, *output dims]. A carries the
base weight's input-dimension names and B its output-dimension names, so the rules shard
them like the weight; the rank dimension (`LORA_RANK`) is in no rule and never sharded.
B starts at zero, so a fresh adapter computes exactly the base model. The adapters are
ordinary parameters of the model; which parameters a step trains (only the adapters, when
`ModelConfig.lora` is set) is the step's business (`jdist.step.trainable`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jdist.errors import require
from jdist.spmd.axes import LORA_RANK

# Target name -> (module, base weight) it adapts, in the order of the model.
TARGETS = {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
           "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down")}
ATTENTION_TARGETS = ("q", "k", "v", "o")
SUFFIX = "_lora"  # the adapter of target t is the attribute f"{t}_lora" of its module


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self, smallest_dim: int, moe: bool) -> None:
        unknown = [t for t in self.targets if t not in TARGETS]
        require(not unknown, f"--lora-targets: unknown target {unknown[0] if unknown else ''!r}; "
                             f"use a comma-separated subset of {','.join(TARGETS)}")
        require(self.targets, "--lora-targets is empty; name at least one of "
                              + ",".join(TARGETS))
        require(len(set(self.targets)) == len(self.targets),
                f"--lora-targets {','.join(self.targets)} names a target twice")
        require(1 <= self.rank <= smallest_dim,
                f"--lora-rank {self.rank} must be between 1 and {smallest_dim} (the smallest "
                "input or output dimension of the adapted weights)")
        mlp = [t for t in self.targets if t not in ATTENTION_TARGETS]
        require(not (moe and mlp),
                f"--lora-targets {','.join(mlp)}: adapters on mixture-of-experts MLPs are not "
                f"supported; use attention targets ({','.join(ATTENTION_TARGETS)}), or add a "
                "shared expert (--shared-d-ff) for them to adapt")


def lora_from_dict(fields: dict | None) -> LoraConfig | None:
    return None if not fields else LoraConfig(fields["rank"], fields["alpha"],
                                              tuple(fields["targets"]))


class Adapter(nnx.Module):
    """The low-rank update of one projection whose weight has `in_shape` input and
    `out_shape` output dimensions (with their logical names)."""

    def __init__(self, in_shape: tuple, in_names: tuple, out_shape: tuple, out_names: tuple,
                 cfg: LoraConfig, rngs: nnx.Rngs):
        fan_in = 1
        for d in in_shape:
            fan_in *= d
        # A ~ N(0, 1/fan_in) (the scale of PEFT's default uniform init); B = 0.
        a = jax.random.normal(rngs.lora(), (*in_shape, cfg.rank), jnp.float32) * fan_in ** -0.5
        self.a = nnx.Param(a, out_sharding=(*in_names, LORA_RANK), eager_sharding=False)
        self.b = nnx.Param(jnp.zeros((cfg.rank, *out_shape), jnp.float32),
                           out_sharding=(LORA_RANK, *out_names), eager_sharding=False)
        self.n_in = len(in_shape)
        self.scale = cfg.scale

    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (the base projection of x) plus this update."""
        xa = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.n_in) * self.scale
        return y + jnp.tensordot(xa, self.b[...].astype(x.dtype), axes=1).astype(y.dtype)


def adapter(cfg: LoraConfig | None, target: str, w: nnx.Param, n_in: int,
            rngs: nnx.Rngs) -> Adapter | None:
    """The adapter of base weight `w` (its first `n_in` dims are inputs) if `target` is one
    of `cfg.targets`, else None."""
    if cfg is None or target not in cfg.targets:
        return None
    names = tuple(w.get_metadata()["out_sharding"])
    return Adapter(w.shape[:n_in], names[:n_in], w.shape[n_in:], names[n_in:], cfg, rngs)


def adapted(x: jax.Array, y: jax.Array, lora: Adapter | None) -> jax.Array:
    return y if lora is None else lora(x, y)


def is_adapter(path) -> bool:
    """Whether a parameter path (keys, or jax tree path entries) lies inside an adapter."""
    return any(str(getattr(k, "key", k)).endswith(SUFFIX) for k in path)
