"""Activation checkpointing on `small`: per-device temporary (activation) bytes from the
compiled step, and step time, for each --remat policy, in one run.

    python benchmarks/remat.py [--mesh dp=1] [--batch-size 16] [--seq-len 256] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jdist import data  # noqa: E402
from jdist.memory import compile_step, predict  # noqa: E402
from jdist.mesh import build_mesh  # noqa: E402
from jdist.remat import NAMES  # noqa: E402
from jdist.rules import DEFAULT_RULES  # noqa: E402
from jdist.step import init_state, make_optimizer, make_plan  # noqa: E402
from models import get_preset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp=1")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mesh = build_mesh(args.mesh, jax.devices()[:1] if args.mesh == "dp=1" else None)
    tx, _ = make_optimizer(1e-3, 10, 1)
    plan = make_plan(get_preset("small"), mesh, DEFAULT_RULES, tx)
    corpus = data.load_corpus(None, args.seq_len)
    batch = data.global_batch(corpus.train, 0, 0, args.batch_size, args.seq_len,
                              plan.batch_sharding)
    rows = []
    for policy in NAMES:
        plan = dataclasses.replace(plan, remat=policy)
        compiled = compile_step(plan, args.batch_size, args.seq_len)
        state = init_state(plan, 0)
        state, m = compiled(state, batch)  # warm-up
        jax.block_until_ready(m)
        start = time.perf_counter()
        for _ in range(args.steps):
            state, m = compiled(state, batch)
        jax.block_until_ready(m)
        rows.append({"remat": policy,
                     "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                     "predicted_activation_bytes": predict(plan, args.batch_size,
                                                           args.seq_len).activations,
                     "step_time_s": (time.perf_counter() - start) / args.steps})
        del state
    base = rows[0]
    for r in rows:
        r["temp_vs_none"] = r["temp_bytes"] / base["temp_bytes"]
        r["time_vs_none"] = r["step_time_s"] / base["step_time_s"]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"small, mesh {args.mesh}, batch {args.batch_size} x {args.seq_len}")
    print(f"{'remat':34} {'temp MiB':>9} {'vs none':>8} {'predicted':>10} {'step s':>7} "
          f"{'vs none':>8}")
    for r in rows:
        print(f"{r['remat']:34} {r['temp_bytes'] / 2**20:9.1f} {r['temp_vs_none']:8.3f} "
              f"{r['predicted_activation_bytes'] / 2**20:10.1f} {r['step_time_s']:7.3f} "
              f"{r['time_vs_none']:8.3f}")


if __name__ == "__main__":
    main()
