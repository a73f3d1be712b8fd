"""A model's blocks as runs: consecutive blocks of one kind, each run its own stacked and
scanned stack (a DeepSeek-style model: dense blocks, then a mixture of experts).

A homogeneous model is one run, stored under `names.BLOCKS` exactly as before, so its
parameter tree, checkpoints and Hugging Face files do not change. Run i > 0 is stored
under `names.run_key(i)`. Blocks of one run share shapes, so one `lax.scan` runs them;
blocks whose shapes differ (a dense MLP, the experts) need runs of their own.
"""

from __future__ import annotations

import dataclasses

from jdist.models.config import ModelConfig
from jdist.models.names import run_key


@dataclasses.dataclass(frozen=True)
class Run:
    """`n_layers` consecutive blocks from layer `first`, all dense or all experts."""

    key: str       # its name in the parameter tree
    first: int     # its first block's index in the model
    n_layers: int
    moe: bool      # the MLP is a mixture of experts
    d_ff: int      # the dense MLP's width (a mixture's: the config's d_ff per expert)


def runs(cfg: ModelConfig) -> tuple[Run, ...]:
    """The config's runs, in model order."""
    dense = cfg.first_dense_layers if cfg.n_experts else cfg.n_layers
    kinds = [(dense, False, cfg.dense_d_ff or cfg.d_ff), (cfg.moe_layers, True, cfg.d_ff)]
    out, first = [], 0
    for n, moe, d_ff in kinds:
        if n:
            out.append(Run(run_key(len(out)), first, n, moe, d_ff))
            first += n
    return tuple(out)


def heterogeneous(cfg: ModelConfig) -> bool:
    """Whether the blocks make more than one run."""
    return len(runs(cfg)) > 1


def moe_offset(cfg: ModelConfig, run: Run) -> int:
    """The row of `run`'s first block in the per-layer balance tables, which count the
    blocks with experts only (`models.loss`)."""
    return run.first - (cfg.n_layers - cfg.moe_layers)
