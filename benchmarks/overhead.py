"""Framework overhead: steady-state steps/s of the full training loop (data, metrics,
logging, progress, goodput, and the health checks at their default intervals) against a bare
loop calling the same compiled step on a fixed batch; and a soak of the silent-data-corruption
checks at every step on the meshes they guard, which must report nothing.

    python benchmarks/overhead.py [--model small] [--mesh dp=2,fsdp=4] [--steps 210]
                                  [--soak-steps 200] [--json]

Target: full / bare >= 0.95. The replica check runs every 100 steps (and before each save),
the recomputed step every 1000: a run of `--steps` shorter than 1000 sees replica checks
only, so the table also prints each check's own cost and its share of a step at its
default interval.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import common
from common import Column

common.setup_devices(8)

import jax

from jdist import data
from jdist.config import TrainConfig
from jdist.step.build import make_train_step
from jdist.step.state import init_state
from jdist.train import health
from jdist.train.loop import prepare, train

COLUMNS = (Column("model", "8"), Column("mesh", "12"),
           Column("bare steps/s", "13.3f", "bare_steps_per_sec"),
           Column("full steps/s", "13.3f", "full_steps_per_sec"), Column("ratio", "7.3f"))


def bare_steps_per_sec(config: TrainConfig, steps: int, warmup: int) -> float:
    setup = prepare(config)
    plan = setup.plan
    state = init_state(plan, config.data.seed)
    batch = data.global_batch(setup.corpus.train, config.data.seed, 0, config.data.batch_size,
                              config.data.seq_len, plan.batch_sharding)
    step = make_train_step(plan, setup.schedule)
    step = step.lower(state, batch).compile()
    # Like the training loop, read each step's metrics one step late: never more than two
    # steps in flight. (Found on jax 0.10.2: XLA CPU deadlocks once ~30-40 multi-device
    # executions with collectives are queued — the rendezvous aborts the process after 40 s.)
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    previous = metrics
    for _ in range(steps - warmup):
        state, metrics = step(state, batch)
        jax.block_until_ready(previous)
        previous = metrics
    jax.block_until_ready(metrics)
    return (steps - warmup) / (time.perf_counter() - start)


def full_steps_per_sec(config: TrainConfig, warmup: int) -> float:
    # The loop still formats and writes everything; only the terminal is spared.
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), \
            contextlib.redirect_stderr(devnull):
        history = train(config)
    steady = history[warmup:]
    return len(steady) / sum(r["step_time_s"] for r in steady)


def check_costs(config: TrainConfig, repeats: int = 5) -> dict:
    """Seconds of one replica check and one recomputed step beyond the step itself, warm."""
    setup = prepare(config)
    plan = setup.plan
    state = init_state(plan, config.data.seed)
    batch = setup.batch(0)
    step = make_train_step(plan, setup.schedule).lower(state, batch).compile()
    health.check_replicas(state, plan.mesh)
    state, metrics = health.recompute_check(step, state, batch)[:2]
    jax.block_until_ready(metrics)

    def timed(fn) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(fn())
        return (time.perf_counter() - start) / repeats

    replica = timed(lambda: health.check_replicas(state, plan.mesh) or 0)
    plain = timed(lambda: step(health.copy_tree(state), batch)[1])
    twice = timed(lambda: health.recompute_check(step, health.copy_tree(state), batch)[1])
    return {"replica_check_s": replica, "recompute_extra_s": twice - plain, "step_s": plain}


def soak(model: str, mesh: str, steps: int) -> dict:
    """Both checks at every step for `steps` steps: a false positive stops the run."""
    with tempfile.TemporaryDirectory() as run_dir, open(os.devnull, "w") as devnull, \
            contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        config = TrainConfig.of(model=model, mesh=mesh, steps=steps, batch_size=8, seq_len=32,
                                eval_every=0, run_dir=run_dir, check_replicas_every=1,
                                recompute_check_every=1)
        try:
            history = train(config)
            return {"mesh": mesh, "steps": len(history), "false_positives": 0}
        except Exception as e:  # noqa: BLE001 - the soak reports what stopped it
            return {"mesh": mesh, "steps": steps, "false_positives": 1, "error": str(e)}


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="dp=2,fsdp=4")
    parser.add_argument("--steps", type=int, default=210)
    parser.add_argument("--soak-steps", type=int, default=200)
    parser.add_argument("--soak-meshes", default="dp=4,fsdp=2;dp=2,tp=2,pp=2")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        config = TrainConfig.of(model=args.model, mesh=args.mesh, steps=args.steps,
                                batch_size=args.batch_size, seq_len=args.seq_len, eval_every=0,
                                log_every=1, run_dir=run_dir)
        # Bare, full, bare: the two bare runs bracket the full one against drift.
        bare1 = bare_steps_per_sec(config, args.steps, args.warmup)
        full = full_steps_per_sec(config, args.warmup)
        bare2 = bare_steps_per_sec(config, args.steps, args.warmup)
        costs = check_costs(config)
    bare = (bare1 + bare2) / 2
    defaults = TrainConfig.of()
    share = {"replica_check": costs["replica_check_s"] / (defaults.observe.check_replicas_every
                                                         * costs["step_s"]),
             "recompute_check": costs["recompute_extra_s"] / (defaults.observe.recompute_check_every
                                                             * costs["step_s"])}
    soaks = [soak("tiny", m, args.soak_steps) for m in args.soak_meshes.split(";")
             if args.soak_steps]
    result = {"model": args.model, "mesh": args.mesh, "steps": args.steps,
              "bare_steps_per_sec": bare, "full_steps_per_sec": full, "ratio": full / bare,
              "target": 0.95, "check_costs": costs, "check_share_at_default": share,
              "soak": soaks}
    common.emit(result, args.json, lambda: text(result, bare1, bare2, defaults.observe))


def text(result: dict, bare1: float, bare2: float, observe) -> list[str]:
    head, row = common.table([result], COLUMNS)
    costs, share = result["check_costs"], result["check_share_at_default"]
    return [head, f"{row}   (target >= 0.95; bare runs {bare1:.3f}, {bare2:.3f})",
            f"one step {costs['step_s'] * 1e3:.1f} ms; replica check "
            f"{costs['replica_check_s'] * 1e3:.1f} ms (every {observe.check_replicas_every}: "
            f"{share['replica_check']:.2%} of step time); recompute check +"
            f"{costs['recompute_extra_s'] * 1e3:.1f} ms (every "
            f"{observe.recompute_check_every}: {share['recompute_check']:.2%})",
            *(f"soak: tiny on {r['mesh']}: both checks at every step for {r['steps']} steps: "
              f"{r['false_positives']} false positives"
              + (f" ({r['error']})" if r.get("error") else "") for r in result["soak"])]


if __name__ == "__main__":
    main()
