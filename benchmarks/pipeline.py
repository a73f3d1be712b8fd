"""Pipeline schedules: the bubble fraction of the executed schedule next to its formula, and
peak per-device temporary bytes of the compiled step, for gpipe, 1f1b and interleaved.

    python benchmarks/pipeline.py [--stages 2 4] [--factors 1 2 4 8] [--micro-batch 4]
                                  [--seq-len 128] [--n-layers 8] [--json]

The micro-batch size is fixed, so M micro-batches make a global batch of M x micro-batch:
the activations of one micro-batch cost the same in every row, and what changes with M is
how many of them a schedule keeps alive. Target: bubble = (P-1)/(V*M+P-1) exactly; 1f1b's
temp bytes flat in M, gpipe's growing linearly. The last columns read the compiled step's
collectives (per device, loop bodies times their trip counts): activation/cotangent
collective-permutes, and everything else (the embedding/head gradient sum over stage only:
block parameters and gradients never leave their stage, interleaved included).
"""

from __future__ import annotations

import common
from common import Column, MiB

common.setup_devices(8)

import jax
import jax.numpy as jnp

from jdist.hlo import executed_collective_bytes
from jdist.mesh import build_mesh
from jdist.models import get_preset
from jdist.parallel.pipeline import PipelineConfig
from jdist.step import make_train_step
from jdist.step.state import with_pipeline

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
COLUMNS = (Column("P", ">2", "stages"), Column("M", ">3", "micro"),
           Column("schedule", "14", lambda r: r["schedule"] + (f" V={r['virtual']}"
                                                               if r["virtual"] > 1 else "")),
           Column("ticks", ">5"), Column("bubble", "7.4f"),
           Column("formula", "7.4f", "bubble_formula"), Column("stashed", ">7"),
           Column("temp MiB", "9.2f", "temp_bytes", MiB),
           Column("permute MiB", "11.2f", "permute_bytes", MiB),
           Column("other MiB", "9.2f", "other_collective_bytes", MiB))


def measure(model, stages: int, micro: int, schedule: str, virtual: int, micro_batch: int,
            seq_len: int) -> dict:
    """Compile one pipelined step ahead of time (nothing is allocated) and read its table."""
    mesh = build_mesh(f"pp={stages}", jax.devices()[:stages])
    config = PipelineConfig(schedule, micro, virtual)
    plan = with_pipeline(common.simple_plan(model, mesh), config)
    tokens = jax.ShapeDtypeStruct((micro * micro_batch, seq_len), jnp.int32)
    compiled = make_train_step(plan).lower(
        plan.abstract, {"inputs": tokens, "targets": tokens}).compile()
    table = config.table(stages)
    moved = executed_collective_bytes(compiled.as_text())
    permute = moved.pop("collective-permute")
    return {"schedule": schedule, "stages": stages, "micro": micro, "virtual": virtual,
            "ticks": table.ticks, "bubble": table.bubble_fraction(),
            "bubble_formula": table.expected_bubble(), "stashed": table.n_slots,
            "temp_bytes": common.temp_bytes(compiled),
            "permute_bytes": permute, "other_collective_bytes": sum(moved.values())}


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="micro-batch counts as multiples of the stage count")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=8)
    args = parser.parse_args()
    model = get_preset("tiny", n_layers=args.n_layers)
    rows = [measure(model, p, f * p, name, v, args.micro_batch, args.seq_len)
            for p in args.stages for f in args.factors for name, v in SCHEDULES]
    result = {"micro_batch": args.micro_batch, "seq_len": args.seq_len,
              "n_layers": args.n_layers, "rows": rows}
    common.emit(result, args.json, lambda: [
        f"tiny ({args.n_layers} layers), micro-batch {args.micro_batch} x {args.seq_len} "
        "tokens, float32; temp = compiled peak per-device temporaries",
        *common.table(rows, COLUMNS)])


if __name__ == "__main__":
    main()
