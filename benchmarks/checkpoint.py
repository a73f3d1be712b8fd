"""Checkpoint costs: how long the training loop is blocked by an async save vs a synchronous
one, restore time onto the same and onto a different mesh, checkpoint vs state bytes, and the
integrity costs: save-to-manifest time (when a checkpoint becomes *good*) and resume-time
validation (default, and the full re-hash).

    python benchmarks/checkpoint.py [--model small] [--mesh fsdp=8] [--other-mesh dp=2,fsdp=2,tp=2]
                                    [--repeats 3] [--json]
    python benchmarks/checkpoint.py --model 1b --n-layers 4 --integrity-only [--repeats 2]

Saves are timed after one warm-up save (the first save of a process also compiles Orbax's
replica-slicing ops; that one-off cost is reported separately). `--integrity-only` skips the
training step, the synchronous saver and the restores: what a model too large to train on
this host needs (shape-only presets such as 1b are then initialised, not refused; their
state must still fit in memory twice over, as an async save copies it to host buffers).
"""

from __future__ import annotations

import inspect
import statistics
import tempfile
import time
from pathlib import Path

import common
from common import Column, MiB

common.setup_devices(8)

import jax
import jax.numpy as jnp

from jdist import checkpoint as ckpt
from jdist import data
from jdist.config import TrainConfig
from jdist.step.build import make_train_step
from jdist.step.from_flags import plan_for
from jdist.step.state import TrainState, init_state
from jdist.train.faults import tree_bytes
from jdist.train.loop import prepare

COLUMNS = (Column("model", "6"), Column("mesh", "8"), Column("step", "{:6.3f}s", "step_s", width=7),
           Column("async blocked", "{:13.3f}s", "async_blocked_s", width=14),
           Column("sync blocked", "{:12.3f}s", "sync_blocked_s", width=13),
           Column("sync/async", "10.1f", "sync_over_async"),
           Column("restore same", "{:12.3f}s", "restore_same_mesh_s", width=13),
           Column("restore other", "{:13.3f}s", "restore_other_mesh_s", width=14),
           Column("ckpt MiB", "9.2f", "checkpoint_bytes", MiB),
           Column("state MiB", "10.2f", "state_bytes", MiB))


def drop_page_cache() -> bool:
    """Whether the kernel's page cache could be dropped (root on Linux), so that a read
    measures the disk, as the first validation of a resumed job on a fresh host does."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def trained(x: jax.Array) -> jax.Array:
    """A float leaf filled with noise, in place: a fresh optimizer state is all zeros, which
    compresses to nothing and would understate the bytes a real checkpoint writes and hashes."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    fill = jax.jit(lambda x: jax.random.normal(jax.random.key(x.size), x.shape, x.dtype) * 1e-3,
                   donate_argnums=0, out_shardings=x.sharding)
    return fill(x)


def integrity(saver: ckpt.Checkpointer, state, first_step: int, repeats: int) -> dict:
    """Save-to-manifest time split into Orbax's commit and the manifest after it, and the
    validation a resume pays (default and full)."""
    commit, total = [], []
    for r in range(first_step, first_step + repeats):
        t = time.perf_counter()
        saver.save(r, state, {"step": r})
        saver._manager.wait_until_finished()  # Orbax committed: the manifest's work starts
        commit.append(time.perf_counter() - t)
        saver.wait()
        total.append(time.perf_counter() - t)
    path = saver.root / str(first_step + repeats - 1)
    full = {"full": True} if "full" in inspect.signature(ckpt.validate).parameters else {}

    def timed(**kw) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            assert ckpt.validate(path, **kw) is None
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    out = {"save_to_manifest_s": statistics.median(total), "commit_s": statistics.median(commit),
           "validate_s": timed(), "validate_full_s": timed(**full),
           "checkpoint_files": sum(1 for p in path.rglob("*") if p.is_file())}
    out["manifest_s"] = out["save_to_manifest_s"] - out["commit_s"]
    if drop_page_cache():
        t = time.perf_counter()
        assert ckpt.validate(path, **full) is None
        out["validate_full_cold_s"] = time.perf_counter() - t
        drop_page_cache()
        t = time.perf_counter()
        assert ckpt.validate(path) is None
        out["validate_cold_s"] = time.perf_counter() - t
    return out


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--n-layers", type=int, default=None,
                        help="override the preset's layer count (to fit a host)")
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--other-mesh", default="dp=2,fsdp=2,tp=2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--integrity-only", action="store_true",
                        help="only the save-to-manifest and validation times (no training step)")
    args = parser.parse_args()
    config = TrainConfig.of(model=args.model, mesh=args.mesh, steps=100, eval_every=0,
                            n_layers=args.n_layers)
    if args.integrity_only:
        _, plan, _ = plan_for(config)  # no shape-only refusal: nothing is compiled
        state = init_state(plan, 0)
        state = state._replace(opt_state=jax.tree.map(trained, state.opt_state))
        with tempfile.TemporaryDirectory() as tmp:
            # keep: no pruning inside the timed saves (deleting an old checkpoint is not
            # the manifest's cost); the disk must hold repeats + 1 checkpoints.
            saver = ckpt.Checkpointer(Path(tmp) / "async", keep=args.repeats + 1)
            t = time.perf_counter()
            saver.save(0, state, {"step": 0})
            saver.wait()
            out = {"model": args.model, "n_layers": plan.model.n_layers, "mesh": args.mesh,
                   "state_bytes": tree_bytes(plan.abstract),
                   "first_save_to_manifest_s": time.perf_counter() - t,
                   **integrity(saver, state, 1, args.repeats)}
            saver.close()
        common.emit(out, args.json, lambda: [f"{k:26} {v}" for k, v in out.items()])
        return
    setup = prepare(config)
    plan = setup.plan
    state = init_state(plan, 0)
    batch = data.global_batch(setup.corpus.train, 0, 0, config.data.batch_size, config.data.seq_len,
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
        out.update(integrity(asyn, state, args.repeats + 1, args.repeats))
        path = root / "async" / str(2 * args.repeats)  # the newest (keep=2 pruned the rest)
        out["checkpoint_bytes"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        out["state_bytes"] = tree_bytes(plan.abstract)
        asyn.close()
        sync.close()
        for name, mesh in (("same", args.mesh), ("other", args.other_mesh)):
            other = prepare(TrainConfig.of(model=args.model, mesh=mesh, steps=100,
                                           n_layers=args.n_layers)).plan
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                tree, _ = ckpt.restore(path, other.abstract, other.shardings)
                TrainState(**tree)
                times.append(time.perf_counter() - t)
            out[f"restore_{name}_mesh_s"] = statistics.median(times)
        out["other_mesh"] = args.other_mesh
    common.emit(out, args.json, lambda: [
        *common.table([out], COLUMNS),
        f"(async save finishes in the background in {out['async_total_s']:.3f}s; the first "
        f"save of a process blocked {out['first_save_blocked_s']:.3f}s; other mesh: "
        f"{args.other_mesh})",
        f"integrity: good (manifest written) {out['save_to_manifest_s']:.3f}s after save() "
        f"(Orbax commit {out['commit_s']:.3f}s + manifest {out['manifest_s']:.3f}s); "
        f"validate on resume {out['validate_s']:.3f}s, full re-hash "
        f"{out['validate_full_s']:.3f}s"])


if __name__ == "__main__":
    main()
