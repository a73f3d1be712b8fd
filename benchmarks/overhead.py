"""Framework overhead: steady-state steps/s of the full training loop (data, metrics,
logging, progress) against a bare loop calling the same compiled step on a fixed batch.

    python benchmarks/overhead.py [--model small] [--mesh fsdp=8] [--steps 30] [--json]

Target: full / bare >= 0.95.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jdist import data
from jdist.train.config import TrainConfig
from jdist.train.loop import prepare, train
from jdist.train.state import init_state
from jdist.train.step import make_train_step


def bare_steps_per_sec(config: TrainConfig, steps: int, warmup: int) -> float:
    setup = prepare(config)
    plan = setup.plan
    state = init_state(plan, config.seed)
    batch = data.global_batch(setup.corpus.train, config.seed, 0, config.batch_size,
                              config.seq_len, plan.batch_sharding)
    step = make_train_step(plan, setup.schedule)
    step = step.lower(state, batch).compile()
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps - warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return (steps - warmup) / (time.perf_counter() - start)


def full_steps_per_sec(config: TrainConfig, warmup: int) -> float:
    # The loop still formats and writes everything; only the terminal is spared.
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), \
            contextlib.redirect_stderr(devnull):
        history = train(config)
    steady = history[warmup:]
    return len(steady) / sum(r["step_time_s"] for r in steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        config = TrainConfig(model=args.model, mesh=args.mesh, steps=args.steps,
                             batch_size=args.batch_size, seq_len=args.seq_len, eval_every=0,
                             log_every=1, run_dir=run_dir)
        # Bare, full, bare: the two bare runs bracket the full one against drift.
        bare1 = bare_steps_per_sec(config, args.steps, args.warmup)
        full = full_steps_per_sec(config, args.warmup)
        bare2 = bare_steps_per_sec(config, args.steps, args.warmup)
    bare = (bare1 + bare2) / 2
    result = {"model": args.model, "mesh": args.mesh, "steps": args.steps,
              "bare_steps_per_sec": bare, "full_steps_per_sec": full, "ratio": full / bare,
              "target": 0.95}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'model':8} {'mesh':12} {'bare steps/s':>13} {'full steps/s':>13} {'ratio':>7}")
    print(f"{args.model:8} {args.mesh:12} {bare:13.3f} {full:13.3f} {full / bare:7.3f}"
          f"   (target >= 0.95; bare runs {bare1:.3f}, {bare2:.3f})")


if __name__ == "__main__":
    main()
