"""Mixtral-style mixture-of-experts MLP: a learned top-k router over E SwiGLU experts.

The routing and expert parallelism live in `jdist.parallel.moe`; this module only owns
the parameters and their logical names.
"""

from __future__ import annotations

import jax
from flax import nnx

from jdist.axes import EMBED, EXPERTS, MLP
from jdist.parallel.moe import moe_ffn
from models.config import ModelConfig
from models.layers import INIT_STD, param


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
        out_std = INIT_STD / (2 * cfg.n_layers) ** 0.5
        self.config = cfg
        self.router = param(rngs, (d, e), (EMBED, None))
        self.w_gate = param(rngs, (e, d, f), (EXPERTS, EMBED, MLP))
        self.w_up = param(rngs, (e, d, f), (EXPERTS, EMBED, MLP))
        self.w_down = param(rngs, (e, f, d), (EXPERTS, MLP, EMBED), std=out_std)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """x [batch, length, d] -> (output, summed load-balancing statistics)."""
        weights = {"router": self.router[...], "w_gate": self.w_gate[...],
                   "w_up": self.w_up[...], "w_down": self.w_down[...]}
        return moe_ffn(x, weights, self.config)
