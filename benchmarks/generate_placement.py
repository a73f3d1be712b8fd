"""Decode speed of generation by where the weights lie: one device, `dp=N` (replicated),
`fsdp=N` with the weights replicated over it (what `python -m jdist.generate` chooses when
they fit, `jdist.generate.placement`) and `fsdp=N` with them sharded as training shards
them (gathered on every token).

    python benchmarks/generate_placement.py [--model small] [--ways 2] [--prompts 8]
                                            [--new-tokens 64] [--json]

Random weights; greedy; float32. Tokens/s counts every prompt's tokens after the first
(which compiles), the best of `--repeats` runs. Every layout must produce the one-device tokens.
"""

from __future__ import annotations

import time

import common
from common import Column

common.setup_devices(8)

import jax
import jax.numpy as jnp
import numpy as np

from jdist.generate import stream
from jdist.generate.placement import replicated_rules
from jdist.generate.weights import inference_plan
from jdist.models import get_preset
from jdist.spmd.mesh import build_mesh
from jdist.spmd.rules import DEFAULT_RULES
from jdist.step.state import init_state

COLUMNS = (Column("layout", "24"), Column("weights", "10"),
           Column("tokens/s", "10.1f", "tokens_per_s"), Column("vs dp", "7.2f", "vs_dp"),
           Column("same tokens", "12", lambda r: str(r["same_tokens"])))


def decode(params, cfg, prompts, new_tokens: int, rules) -> tuple[np.ndarray, float]:
    """(the tokens [new_tokens, batch], tokens/s after the first step)."""
    steps = stream(params, cfg, prompts, new_tokens, rules=rules)
    out = [next(steps)]
    start = time.perf_counter()
    out += list(steps)
    elapsed = time.perf_counter() - start
    return np.stack(out), (new_tokens - 1) * len(prompts) / elapsed


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--ways", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    cfg, n = get_preset(args.model), args.ways
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 16).astype(np.int32) for _ in range(args.prompts)]
    one = inference_plan(cfg, build_mesh("", jax.devices()[:1]))
    host = jax.device_get(init_state(one, 0).params)
    layouts = [("one device", "", DEFAULT_RULES, "whole"),
               (f"dp={n}", f"dp={n}", DEFAULT_RULES, "whole"),
               (f"fsdp={n} replicated", f"fsdp={n}", replicated_rules(), "whole"),
               (f"fsdp={n} sharded", f"fsdp={n}", DEFAULT_RULES, f"1/{n}")]
    rows, reference, dp_rate = [], None, None
    for name, mesh_text, rules, held in layouts:
        mesh = build_mesh(mesh_text, jax.devices()[:1 if not mesh_text else n])
        plan = inference_plan(cfg, mesh, rules, jnp.float32)
        params = jax.device_put(host, plan.shardings.params)
        runs = [decode(params, cfg, prompts, args.new_tokens, rules) for _ in range(args.repeats)]
        tokens, rate = runs[0][0], max(r for _, r in runs)
        reference = tokens if reference is None else reference
        dp_rate = rate if name.startswith("dp") else dp_rate
        rows.append({"layout": name, "weights": held, "tokens_per_s": rate,
                     "same_tokens": bool((tokens == reference).all())})
    for row in rows:
        row["vs_dp"] = row["tokens_per_s"] / dp_rate
    common.emit({"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens,
                 "rows": rows}, args.json, lambda: common.table(rows, COLUMNS))


if __name__ == "__main__":
    main()
