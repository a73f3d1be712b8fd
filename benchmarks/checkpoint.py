"""Checkpoint costs: how long the training loop is blocked by an async save vs a synchronous
one, restore time onto the same and onto a different mesh, checkpoint vs state bytes.

    python benchmarks/checkpoint.py [--model small] [--mesh fsdp=8] [--other-mesh dp=2,fsdp=2,tp=2]
                                    [--repeats 3] [--json]

Saves are timed after one warm-up save (the first save of a process also compiles Orbax's
replica-slicing ops; that one-off cost is reported separately).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jdist import checkpoint as ckpt
from jdist import data
from jdist.train.config import TrainConfig
from jdist.train.faults import tree_bytes
from jdist.train.loop import prepare
from jdist.train.state import TrainState, init_state
from jdist.train.step import make_train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--other-mesh", default="dp=2,fsdp=2,tp=2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = TrainConfig(model=args.model, mesh=args.mesh, steps=100, eval_every=0)
    setup = prepare(config)
    plan = setup.plan
    state = init_state(plan, 0)
    batch = data.global_batch(setup.corpus.train, 0, 0, config.batch_size, config.seq_len,
                              plan.batch_sharding)
    step = make_train_step(plan, setup.schedule)
    step = step.lower(state, batch).compile()
    state, m = step(state, batch)
    jax.block_until_ready(m)

    def timed_step() -> float:
        nonlocal state
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - t

    step_s = statistics.median(timed_step() for _ in range(5))
    out: dict = {"model": args.model, "mesh": args.mesh, "step_s": step_s}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        asyn = ckpt.Checkpointer(root / "async", keep=2)
        sync = ckpt.Checkpointer(root / "sync", keep=2, use_async=False)
        t = time.perf_counter()
        asyn.save(0, state, {"step": 0})
        out["first_save_blocked_s"] = time.perf_counter() - t
        asyn.wait()
        sync.save(0, state, {"step": 0})
        sync.wait()
        blocked_async, blocked_sync, total_async = [], [], []
        for r in range(1, args.repeats + 1):
            # Async: the loop pays the save() call, then keeps stepping while it writes.
            t = time.perf_counter()
            asyn.save(r, state, {"step": r})
            blocked_async.append(time.perf_counter() - t)
            timed_step()
            asyn.wait()
            total_async.append(time.perf_counter() - t)
            # Synchronous: the loop waits until the checkpoint is on disk.
            t = time.perf_counter()
            sync.save(r, state, {"step": r})
            sync.wait()
            blocked_sync.append(time.perf_counter() - t)
        out["async_blocked_s"] = statistics.median(blocked_async)
        out["async_total_s"] = statistics.median(total_async)
        out["sync_blocked_s"] = statistics.median(blocked_sync)
        out["sync_over_async"] = out["sync_blocked_s"] / out["async_blocked_s"]
        path = root / "async" / str(args.repeats)
        out["checkpoint_bytes"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        out["state_bytes"] = tree_bytes(plan.abstract)
        asyn.close()
        sync.close()
        for name, mesh in (("same", args.mesh), ("other", args.other_mesh)):
            other = prepare(TrainConfig(model=args.model, mesh=mesh, steps=100)).plan
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                tree, _ = ckpt.restore(path, other.abstract, other.shardings)
                TrainState(**tree)
                times.append(time.perf_counter() - t)
            out[f"restore_{name}_mesh_s"] = statistics.median(times)
        out["other_mesh"] = args.other_mesh
    if args.json:
        print(json.dumps(out))
        return
    mib = 2**20
    print(f"{'model':6} {'mesh':8} {'step':>7} {'async blocked':>14} {'sync blocked':>13} "
          f"{'sync/async':>10} {'restore same':>13} {'restore other':>14} {'ckpt MiB':>9} "
          f"{'state MiB':>10}")
    print(f"{args.model:6} {args.mesh:8} {step_s:6.3f}s {out['async_blocked_s']:13.3f}s "
          f"{out['sync_blocked_s']:12.3f}s {out['sync_over_async']:10.1f} "
          f"{out['restore_same_mesh_s']:12.3f}s {out['restore_other_mesh_s']:13.3f}s "
          f"{out['checkpoint_bytes'] / mib:9.2f} {out['state_bytes'] / mib:10.2f}")
    print(f"(async save finishes in the background in {out['async_total_s']:.3f}s; the first "
          f"save of a process blocked {out['first_save_blocked_s']:.3f}s; other mesh: "
          f"{args.other_mesh})")


if __name__ == "__main__":
    main()
