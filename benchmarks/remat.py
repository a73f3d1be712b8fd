"""Activation checkpointing on `small`: per-device temporary (activation) bytes from the
compiled step, and step time, for each --remat policy, in one run.

    python benchmarks/remat.py [--mesh dp=1] [--batch-size 16] [--seq-len 256] [--json]
"""

from __future__ import annotations

import common
from common import Column, MiB

common.setup_devices(8)

import jax

from jdist import data
from jdist.memory import compile_step, predict
from jdist.models import get_preset
from jdist.models.remat import NAMES
from jdist.spmd.mesh import build_mesh
from jdist.step import init_state

COLUMNS = (Column("remat", "34"), Column("temp MiB", "9.1f", "temp_bytes", MiB),
           Column("vs none", "8.3f", "temp_vs_none"),
           Column("predicted", "10.1f", "predicted_activation_bytes", MiB),
           Column("step s", "7.3f", "step_time_s"), Column("vs none", "8.3f", "time_vs_none"))


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--mesh", default="dp=1")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    mesh = build_mesh(args.mesh, jax.devices()[:1] if args.mesh == "dp=1" else None)
    plan = common.simple_plan(get_preset("small"), mesh)
    corpus = data.load_corpus(None, args.seq_len)
    batch = data.global_batch(corpus.train, 0, 0, args.batch_size, args.seq_len,
                              plan.batch_sharding)
    rows = []
    for policy in NAMES:
        plan = plan.computing(remat=policy)
        compiled = compile_step(plan, args.batch_size, args.seq_len)
        seconds = common.time_steps(compiled, init_state(plan, 0), [batch], args.steps)[2]
        rows.append({"remat": policy, "temp_bytes": common.temp_bytes(compiled),
                     "predicted_activation_bytes": predict(plan, args.batch_size,
                                                           args.seq_len).activations,
                     "step_time_s": seconds / args.steps})
    base = rows[0]
    for r in rows:
        r["temp_vs_none"] = r["temp_bytes"] / base["temp_bytes"]
        r["time_vs_none"] = r["step_time_s"] / base["step_time_s"]
    common.emit(rows, args.json, lambda: [
        f"small, mesh {args.mesh}, batch {args.batch_size} x {args.seq_len}",
        *common.table(rows, COLUMNS)])


if __name__ == "__main__":
    main()
