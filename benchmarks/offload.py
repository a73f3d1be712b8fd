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

    python benchmarks/offload.py [--modes none,optimizer,params] [--disk DIR] [--layers 4] [--json]
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


def memory_row(mode: str) -> dict:
    config = TrainConfig.of(model=MODEL, mesh=MESH, offload=mode, batch_size=BATCH,
                            seq_len=SEQ, remat="full")
    _, plan, _ = plan_for(config)
    start = time.perf_counter()
    compiled = lower_step(plan, BATCH, SEQ).compile()
    seconds = time.perf_counter() - start
    args = arguments(compiled.as_text())
    device_args = sum(b for b, host in args if not host)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {"offload": mode, "device_arguments": device_args,
            "host_arguments": sum(b for b, host in args if host), "temporaries": temp,
            "device_total": device_args + temp,
            "predicted": predict(plan, BATCH, SEQ).total, "compile_s": round(seconds, 1)}


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
    args = parser.parse_args()
    rows = [memory_row(mode) for mode in args.modes.split(",")]
    disk = disk_row(args.disk, args.layers) if args.disk else None
    gib = lambda key: Column(key.replace("_", " "), "10.2f", key, scale=GiB)

    def text():
        yield (f"{MODEL} {MESH}, {BATCH} x {SEQ} tokens, remat full, float32 state; XLA CPU "
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

    common.emit({"memory": rows, "disk": disk}, args.json, text)


if __name__ == "__main__":
    main()
