"""A layer run on two halves of the micro-batch's rows, one after the other (`--tp-halves`).

Within one half every tensor-parallel activation collective (sequence parallelism's
all-gather before attention and MLP and reduce-scatter after them, or the all-reduces
without it) feeds, or is fed by, the next matmul: XLA can only wait for it. Across halves
they are independent, so the GPU scheduler can run one half's collective beside the other
half's matmuls. On the GPU compiler (H100 target, jax 0.10.2) this hid more than half of
the exposed collectives of a 70B sequence-parallel step
(docs/measurements.md#tensor-collectives; docs/gpu.md, "Hiding communication").

The same function: rows are independent through a block (attention and MLP per row, norms
per token), and each weight's gradient is the sum of the two halves'. Each half keeps at
least two rows: with one, GSPMD's partitioning of the squeezed batch gathers activations
twice as often (docs/measurements.md#tensor-collectives). Mixture-of-experts layers are not
split: their capacity and balance statistics are over the whole micro-batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdist.errors import require

MIN_ROWS = 4  # two halves of at least two rows each (module doc)


def rows_fit(local_rows: int) -> bool:
    """Whether a micro-batch of `local_rows` rows on one device splits into halves."""
    return local_rows >= MIN_ROWS and local_rows % 2 == 0


def check(local_rows: int, n_experts: int) -> None:
    """Refuse what `--tp-halves` cannot split: `local_rows` is the rows of a micro-batch
    on one device."""
    require(not n_experts, "--tp-halves splits dense layers only (MoE capacity and balance "
            "are over the whole micro-batch); drop --tp-halves")
    require(rows_fit(local_rows),
            f"--tp-halves needs an even number of at least {MIN_ROWS} rows per device and "
            f"micro-batch, this step has {local_rows}; raise --batch-size, lower "
            "--grad-accum, or drop --tp-halves")


def split(layer, rows: dict):
    """`layer(x, state, rows) -> (x, stats)` as `(x, state) -> (x, stats)` run on the two
    halves of x's rows (and of `rows`, split alike); stats are a dense layer's (empty)."""

    def run(x, state):
        parts = [layer(x_half, state, jax.tree.map(lambda r, i=i: jnp.split(r, 2)[i], rows))
                 for i, x_half in enumerate(jnp.split(x, 2))]
        return jnp.concatenate([y for y, _ in parts]), parts[0][1]

    return run
