"""Offload: the compiled step's device memory under each --offload mode, and disk bandwidth.

Memory: llama3-8b on fsdp=8 (ZeRO over fsdp; float32 master weights and AdamW moments, remat
full, 8 x 1024 tokens), the training step compiled ahead of time on abstract inputs for
each `--offload` mode, by XLA's CPU compiler on 8 simulated devices. Not the H100 GPU
compiler: its deviceless devices have no host memory space (jax 0.10.2; a pinned_host
sharding compiles as device memory, so `--offload` is refused with `--target`). The CPU
compiler keeps the memory spaces in the compiled entry layout (`S(5)`: host) but counts host
buffers in its own totals, so device bytes are read off the layout: each argument's
per-device bytes in the device space, then the compiler's temporaries (on the CPU the host
computation's temporaries are among them: an upper bound on the device's). Beside them the
memory model's prediction (`jdist.memory.predict`).

Disk (`--disk DIR`): the per-device AdamW state of llama3-8b's layers on fsdp=8 (two float32
moments of one layer's block, about 218 MB per device and layer) written to and read back
from `np.memmap` files in DIR one layer at a time, as a disk-offloaded optimizer would
stream them; the files are flushed (fsync) before a write is timed as done, and evicted from
the page cache (posix_fadvise DONTNEED) before they are read, so a read comes from the disk.

Streaming (`--disk DIR`): a real `--offload disk` run with its moments' files in DIR, the
bytes and seconds of the per-layer reads and writes (`streaming_row`).

    python benchmarks/offload.py [--modes none,optimizer,params,disk] [--disk DIR]
        [--layers 4] [--stream-steps 2] [--target h100-80gb] [--optimizer muon] [--json]
"""

from __future__ import annotations

import os
import re
import time

import common
from common import Column, GiB

common.setup_devices(8, cpu_only=True)

import numpy as np

from jdist.config import TrainConfig
from jdist.memory import lower_step, predict
from jdist.step.from_flags import plan_for

MODEL, MESH, BATCH, SEQ = "llama3-8b", "fsdp=8", 8, 1024
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "pred": 1, "u32": 4, "s8": 1, "u8": 1}
HOST = "S(5)"


def arguments(hlo: str) -> list[tuple[int, bool]]:
    """(per-device bytes, in host memory) of each argument of the compiled entry layout."""
    inputs = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo).group(1)
    out = []
    for dtype, dims, layout in re.findall(r"(\w+)\[([\d,]*)\](\{[^}]*\})?", inputs):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append((n * BYTES[dtype], HOST in (layout or "")))
    return out


def memory_row(mode: str, optimizer: str = "adamw") -> dict:
    config = TrainConfig.of(model=MODEL, mesh=MESH, offload=mode, batch_size=BATCH,
                            seq_len=SEQ, remat="full", optimizer=optimizer)
    _, plan, _ = plan_for(config)
    start = time.perf_counter()
    compiled = lower_step(plan, BATCH, SEQ).compile()
    seconds = time.perf_counter() - start
    args = arguments(compiled.as_text())
    device_args = sum(b for b, host in args if not host)
    analysis = compiled.memory_analysis()
    # --offload disk's device program returns the gradients (the walk reads them); every
    # other mode's outputs alias its donated state.
    temp = analysis.temp_size_in_bytes + (analysis.output_size_in_bytes if plan.on_disk else 0)
    row = {"offload": mode, "optimizer": optimizer, "device_arguments": device_args,
           "host_arguments": sum(b for b, host in args if host), "temporaries": temp,
           "device_total": device_args + temp,
           "predicted": predict(plan, BATCH, SEQ).total,
           "compile_s": round(seconds, 1)}
    if plan.on_disk:
        row["update_peak"] = disk_update_peak(plan)
        row["device_total"] = max(row["device_total"], row["update_peak"])
    return row


def target_row(mode: str, target: str, optimizer: str = "adamw") -> dict:
    """`--target`: the step compiled for a GPU deviceless, for the modes it can compile
    (none and disk: the GPU target has no host memory space); device bytes from the
    compiler's own totals (arguments + outputs - aliased + temporaries)."""
    config = TrainConfig.of(model=MODEL, mesh=MESH, offload=mode, batch_size=BATCH,
                            seq_len=SEQ, remat="full", target=target, optimizer=optimizer)
    _, plan, _ = plan_for(config)
    a = lower_step(plan, BATCH, SEQ).compile().memory_analysis()
    row = {"offload": mode, "target": target, "step_total": a.argument_size_in_bytes
           + a.output_size_in_bytes - a.alias_size_in_bytes + a.temp_size_in_bytes}
    row.update(disk_walk(plan) if plan.on_disk else
               {"update_peak": 0, "walk_collective_bytes": 0})
    row["predicted"] = predict(plan, BATCH, SEQ).total
    return row


def disk_update_peak(plan) -> int:
    """--offload disk: the largest per-device footprint of the walk's programs (one group's,
    and the embedding's and head's), each compiled on abstract inputs: parameters and
    gradients whole, one group's moments in and out, temporaries."""
    return disk_walk(plan)["update_peak"]


def disk_walk(plan) -> dict:
    """--offload disk's walk compiled: its largest program's peak per device, and the bytes
    its collectives move per device per step (each stacked group's program runs once per
    group: under Muon, the owner layout's all-to-alls)."""
    from jdist.step.disk_update import LayerUpdate
    from jdist.tools.comm import collectives

    update, peak, moved = LayerUpdate(plan), 0, 0
    for whole in (False, True):
        members = next(m for layer, m in update.walk if (layer is None) == whole)
        compiled = update.compiled(whole, members).lower(
            *update.abstract_args(whole, members)).compile()
        a = compiled.memory_analysis()
        peak = max(peak, a.argument_size_in_bytes + a.output_size_in_bytes
                   - a.alias_size_in_bytes + a.temp_size_in_bytes)
        runs = 1 if whole else len(update.walk) - 1
        moved += runs * sum(c.bytes * c.times for c in collectives(
            compiled.as_text(), plan.mesh.devices.size))
    return {"update_peak": peak, "walk_collective_bytes": moved}


def streaming_row(directory: str, steps: int, evict: bool) -> dict:
    """--offload disk in a real run: a 4-layer d_model 512 model (17M parameters, 134 MB
    of moments) on fsdp=4,tp=2 for `steps` steps with its files in `directory`; the bytes
    and seconds of the walk's reads (on its thread) and writes (`LayerUpdate.io`), after a
    first step that compiles. `evict`: the files' pages dropped from the page cache before
    each step, so the reads come from the disk (else from the cache the last step wrote)."""
    from pathlib import Path

    import jax

    from jdist import data
    from jdist.step import moment_files
    from jdist.step.build import make_train_step
    from jdist.step.state import init_state

    config = TrainConfig.of(model="small", mesh="fsdp=4,tp=2", offload="disk", batch_size=8,
                            seq_len=128, d_model=512, n_heads=8, n_kv_heads=8, d_ff=2048,
                            n_layers=4, vocab_size=4096, compute_dtype="float32")
    _, plan, _ = plan_for(config)
    state = init_state(plan, 0)
    state = state._replace(opt_state=moment_files.to_disk(
        state.opt_state, Path(directory), moment_files.stacked_keys(plan)))
    step = make_train_step(plan)
    tokens = np.random.default_rng(0).integers(0, 4096, 1 << 20, dtype=np.int32)
    for i in range(steps + 1):
        if i == 1:  # the first step compiled the programs
            step.update.io.update(read_bytes=0, read_s=0.0, write_bytes=0, write_s=0.0)
            start = time.perf_counter()
        if evict:
            for f in moment_files.moments(state.opt_state).values():
                fd = os.open(f.filename, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        batch = data.global_batch(tokens, 0, i, 8, 128, plan.batch_sharding)
        state, metrics = step(state, batch)
        jax.block_until_ready(state.params)
    seconds = time.perf_counter() - start
    io = step.update.io
    for f in moment_files.moments(state.opt_state).values():
        os.remove(f.filename)
    return {"evict": evict, "steps": steps, "step_s": seconds / steps, **io,
            "read_gbps": io["read_bytes"] / io["read_s"] / 1e9,
            "write_gbps": io["write_bytes"] / io["write_s"] / 1e9}


def disk_row(directory: str, layers: int) -> dict:
    """Write, then read back, `layers` layers' per-device AdamW moments as memmap files."""
    from jdist.models import get_preset

    cfg = get_preset(MODEL)
    kv = cfg.n_kv_heads * cfg.d_model // cfg.n_heads
    per_layer = 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * kv \
        + 3 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model  # wq, wo, wk, wv, the MLP, two norms
    moments = 2 * per_layer // 8  # float32 mu and nu of one device's shard
    rng = np.random.default_rng(0)
    chunk = rng.standard_normal(moments, dtype=np.float32)
    paths = [os.path.join(directory, f"opt-layer-{i}.f32") for i in range(layers)]
    start = time.perf_counter()
    for path in paths:
        out = np.memmap(path, np.float32, "w+", shape=(moments,))
        out[:] = chunk
        out.flush()
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read below hits the disk
        os.close(fd)
        del out
    write = time.perf_counter() - start
    start, total = time.perf_counter(), 0.0
    for path in paths:
        total += float(np.array(np.memmap(path, np.float32, "r", shape=(moments,)))[-1])
    read = time.perf_counter() - start
    for path in paths:
        os.remove(path)
    size = layers * moments * 4
    return {"layers": layers, "bytes_per_layer": moments * 4, "write_gbps": size / write / 1e9,
            "read_gbps": size / read / 1e9, "checksum": total}


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--modes", default="none,optimizer,params")
    parser.add_argument("--disk", default="", help="a directory on the disk to measure")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--optimizer", default="adamw", help="adamw or muon (the memory rows)")
    parser.add_argument("--stream-steps", type=int, default=2,
                        help="with --disk: steps of a real --offload disk run to time")
    common.add_target(parser, "also compile --offload none and disk for this GPU",
                      "default none")
    args = parser.parse_args()
    target = common.requested_target(parser, args, default=False)
    gpu = [target_row(mode, target, args.optimizer) for mode in ("none", "disk")] \
        if target else []
    rows = [memory_row(mode, args.optimizer) for mode in args.modes.split(",") if mode]
    disk = disk_row(args.disk, args.layers) if args.disk else None
    streams = [streaming_row(args.disk, args.stream_steps, evict) for evict in (False, True)] \
        if args.disk and args.stream_steps else []
    gib = lambda key: Column(key.replace("_", " "), "10.2f", key, scale=GiB)

    def text():
        yield (f"{MODEL} {MESH}, {args.optimizer}, {BATCH} x {SEQ} tokens, remat full, "
               "float32 state; XLA CPU "
               "compiler (the H100 target has no host memory space); GiB per device")
        yield from common.table(rows, [Column("offload", "<9"),
                                       gib("device_arguments"), gib("host_arguments"),
                                       gib("temporaries"), gib("device_total"),
                                       gib("predicted"), Column("compile s", "9.0f",
                                                                "compile_s")])
        if disk:
            yield (f"disk {args.disk}: {disk['layers']} layers of "
                   f"{disk['bytes_per_layer'] / 2**20:.0f} MiB (one device's AdamW moments "
                   f"per layer): write {disk['write_gbps']:.2f} GB/s, read "
                   f"{disk['read_gbps']:.2f} GB/s")
        for s in streams:
            yield (f"--offload disk streaming in a real run ({s['steps']} steps, "
                   f"{'pages evicted before each step' if s['evict'] else 'page cache'}): "
                   f"read {s['read_bytes'] / 2**20:.0f} MiB in {s['read_s']:.2f}s "
                   f"({s['read_gbps']:.2f} GB/s), wrote {s['write_bytes'] / 2**20:.0f} MiB "
                   f"in {s['write_s']:.2f}s ({s['write_gbps']:.2f} GB/s); "
                   f"{s['step_s']:.2f} s/step")
        for row in gpu:
            yield (f"{row['target']} compiler (deviceless), --offload {row['offload']}: step "
                   f"{row['step_total'] / GiB:.2f} GiB per device"
                   + (f", the walk's largest program {row['update_peak'] / GiB:.2f}"
                      if row["update_peak"] else "")
                   + (f" (its collectives {row['walk_collective_bytes'] / GiB:.1f} GiB a "
                      "step)" if row["update_peak"] else "")
                   + f"; predicted {row['predicted'] / GiB:.2f}")
        for row in rows:
            if "update_peak" in row:
                yield (f"--offload disk: the walk's largest program {row['update_peak'] / GiB:.2f} "
                       "GiB per device (device total is the larger of it and the gradient "
                       "program's)")

    common.emit({"memory": rows, "disk": disk, "streaming": streams, "target": gpu},
                args.json, text)


if __name__ == "__main__":
    main()
