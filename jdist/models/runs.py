"""A model's blocks as runs: consecutive blocks of one kind, each run its own stacked and
scanned stack (a DeepSeek-style model: dense blocks, then a mixture of experts).

A homogeneous model is one run, stored under `names.BLOCKS` exactly as before, so its
parameter tree, checkpoints and Hugging Face files do not change. Run i > 0 is stored
under `names.run_key(i)`. Blocks of one run share shapes, so one `lax.scan` runs them;
blocks whose shapes differ (a dense MLP, the experts) need runs of their own. A sliding
window is static (the kernels skip the blocks outside it), so layers with other windows
are other stacks too; a repeating pattern (gpt-oss's sliding and full layers in turn,
Gemma 3's five local to one global) is one run whose rows are periods (`models.llama.Period`),
scanned like any stack.
"""

from __future__ import annotations

import dataclasses
import math

from jdist.models.config import ModelConfig
from jdist.models.names import run_key


@dataclasses.dataclass(frozen=True)
class Run:
    """`n_layers` consecutive blocks from layer `first`, all dense or all experts. With a
    repeating attention pattern (`kinds` of more than one block: a period) the stack's
    rows are periods, `n_layers / period` of them, each one block per entry."""

    key: str       # its name in the parameter tree
    first: int     # its first block's index in the model
    n_layers: int
    moe: bool      # the MLP is a mixture of experts
    d_ff: int      # the dense MLP's width (a mixture's: the config's d_ff per expert)
    # Each block's attention over one period, (sliding window or None for all keys,
    # rotary embeddings or not: `kind_of`); (): one block a row, as the config says.
    kinds: tuple = ()

    @property
    def period(self) -> int:
        """Blocks in one row of the stack."""
        return max(1, len(self.kinds))

    @property
    def rows(self) -> int:
        """The stack's length: what its layer loop scans and pipeline stages split."""
        return self.n_layers // self.period

    @property
    def windows(self) -> tuple:
        return tuple(window for window, _ in self.kinds)


def kind_of(cfg: ModelConfig, layer: int) -> tuple[int | None, bool]:
    """Layer `layer`'s attention: (its sliding window: every `full_attention_every`-th layer
    attends to all keys (gpt-oss: every 2nd, Gemma 3: every 6th), the others to the
    window; whether it rotates queries and keys: every `nope_every`-th layer does not
    (Llama 4, SmolLM3: every 4th))."""
    full, nope = (every and (layer + 1) % every == 0
                  for every in (cfg.full_attention_every, cfg.nope_every))
    return (None if full else cfg.sliding_window), not nope


def window_of(cfg: ModelConfig, layer: int) -> int | None:
    """Layer `layer`'s sliding window (`kind_of`); None: it attends to every earlier key."""
    return kind_of(cfg, layer)[0]


def period_of(cfg: ModelConfig) -> int:
    """The attention pattern's period in layers; 0: every layer alike, as the config says."""
    everys = [e for e in (cfg.full_attention_every if cfg.sliding_window else 0,
                          cfg.nope_every) if e]
    return math.lcm(*everys) if everys else 0


def runs(cfg: ModelConfig) -> tuple[Run, ...]:
    """The config's runs, in model order: its dense blocks, then its experts, each split
    where the attention pattern asks (`_pieces`)."""
    dense = cfg.first_dense_layers if cfg.n_experts else cfg.n_layers
    parts = [(0, dense, False, cfg.dense_d_ff or cfg.d_ff),
             (dense, cfg.n_layers, True, cfg.d_ff)]
    out = []
    for a, b, moe, d_ff in parts:
        for first, n, kinds in _pieces(cfg, a, b):
            out.append(Run(run_key(len(out)), first, n, moe, d_ff, kinds))
    return tuple(out)


def _pieces(cfg: ModelConfig, a: int, b: int):
    """(first, n_layers, kinds) of the runs of layers a..b-1: whole periods of the
    attention pattern as one periodic run; layers before and after them, runs of equal
    kinds."""
    every = period_of(cfg)
    if not every:
        return [(a, b - a, ())] if b > a else []
    if every == 1:
        return _equal_kinds(cfg, a, b)
    start = min(b, a + (-a) % every)  # the first layer that starts a period
    periods = (b - start) // every
    end = start + periods * every
    pattern = tuple(kind_of(cfg, i) for i in range(start, start + every))
    body = [(start, end - start, pattern)] if periods else []
    return _equal_kinds(cfg, a, start) + body + _equal_kinds(cfg, end, b)


def _equal_kinds(cfg: ModelConfig, a: int, b: int) -> list:
    """Layers a..b-1 as runs of one kind each."""
    out = []
    for i in range(a, b):
        if out and kind_of(cfg, i) == out[-1][2][0]:
            first, n, kinds = out[-1]
            out[-1] = (first, n + 1, kinds)
        else:
            out.append((i, 1, (kind_of(cfg, i),)))
    return out


def heterogeneous(cfg: ModelConfig) -> bool:
    """Whether the blocks make more than one run."""
    return len(runs(cfg)) > 1


def moe_offset(cfg: ModelConfig, run: Run) -> int:
    """The row of `run`'s first block in the per-layer balance tables, which count the
    blocks with experts only (`models.loss`)."""
    return run.first - (cfg.n_layers - cfg.moe_layers)
