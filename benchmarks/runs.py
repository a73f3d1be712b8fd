"""Heterogeneous stacks (`jdist.models.runs`): compile time and compiled step of models whose
blocks make one run, two runs (dense then experts) or a run of periods (sliding and full
attention in turn, gpt-oss; five sliding to one full, Gemma 3), at two depths, on the XLA
CPU compiler. Each run is one scanned layer loop, so compile time follows the runs, not
the depth.

    python benchmarks/runs.py [--mesh fsdp=8] [--depths 6,24] [--json]
"""

from __future__ import annotations

import dataclasses
import time

import common
from common import Column, MiB

common.setup_devices(8)

import jax

from jdist.memory import lower_step
from jdist.models import get_preset
from jdist.models.runs import runs
from jdist.spmd.mesh import build_mesh

VARIANTS = {  # name: (preset, overrides at depth L)
    "one run": ("tiny", lambda n: {}),
    "dense then experts": ("moe-tiny", lambda n: {"first_dense_layers": 2, "dense_d_ff": 128}),
    "sliding/full (every 2)": ("tiny", lambda n: {"sliding_window": 16,
                                                  "full_attention_every": 2}),
    "5 sliding/1 full (every 6)": ("tiny", lambda n: {"sliding_window": 16,
                                                      "full_attention_every": 6}),
}
COLUMNS = (Column("model", "28"), Column("layers", "6d"), Column("runs", "4d"),
           Column("rows", "10"), Column("compile s", "9.2f", "compile_s"),
           Column("loops", "5d", "while_loops"), Column("temp MiB", "8.2f", "temp_bytes", MiB))


def measure(name: str, n_layers: int, mesh, batch: int, seq: int) -> dict:
    preset, overrides = VARIANTS[name]
    model = dataclasses.replace(get_preset(preset), n_layers=n_layers, **overrides(n_layers))
    model.validate()
    plan = common.simple_plan(model, mesh)
    lowered = lower_step(plan, batch, seq)
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    return {"model": name, "layers": n_layers, "runs": len(runs(model)),
            "rows": "+".join(str(r.rows) for r in runs(model)), "compile_s": seconds,
            "while_loops": text.count(" while("), "temp_bytes": common.temp_bytes(compiled)}


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--depths", default="6,24")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    mesh = build_mesh(args.mesh, jax.devices())
    rows = [measure(name, int(n), mesh, args.batch_size, args.seq_len)
            for name in VARIANTS for n in args.depths.split(",")]
    common.emit(rows, args.json, lambda: [
        f"mesh {args.mesh}, batch {args.batch_size} x {args.seq_len}, XLA CPU compiler "
        f"(jax {jax.__version__})", *common.table(rows, COLUMNS)])


if __name__ == "__main__":
    main()
