"""Sliding-window attention's cost as compiled: one layer's attention, forward and backward,
one sequence, under windows of several sizes, counted from the program XLA's GPU compiler
builds for `--target` (default h100-80gb; compile-only devices, nothing runs).

`flash` is jdist's blockwise kernel: with a window each query tile runs a fixed number of
key tiles (its own and those holding the window before it; tiles of the window's size
rounded up to a power of two, 128 to 512), so the executed matmul FLOPs
(`jdist.tools.gpu_report`: every dot times the trip counts of the loops around it) grow
with the window, not with the sequence. Without a window the causal loops' trip counts
depend on the tile, which the compiler cannot know: they are counted at their mean.
`cudnn` is jax's cuDNN fused attention with its local window, compiled to one fused call
whose config carries `sliding_window_length`; its FLOPs are the report's model of that
call (the window's share of the scores: cuDNN skips the tiles outside the window), not a
count of executed tiles. `x causal` is each row's FLOPs over the causal (no window) row
of its kernel; `window share` is the share of the causal mask's (query, key) pairs the
window keeps, what an ideal kernel would execute.

    python benchmarks/sliding_window.py [--json] [--target h100-80gb] [--seq-len 32768]

Shape: gpt-oss's attention (64 query heads, 8 kv heads, head_dim 64), bfloat16.
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(1, cpu_only=True)

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jdist.parallel.attention import cudnn_attention
from jdist.parallel.attention.blockwise import Q_TILE
from jdist.parallel.attention.flash import flash_attention
from jdist.runtime import target as gpu_target
from jdist.spmd.mesh import build_mesh
from jdist.tools import gpu_report

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64
WINDOWS = (None, 128, 1024, 4096)  # gpt-oss's, Gemma 3's, Gemma 2's


def pairs_kept(seq: int, window: int | None) -> float:
    """The share of causal (query, key) pairs within the window."""
    causal = seq * (seq + 1) / 2
    if window is None or window >= seq:
        return 1.0
    return (window * (window + 1) / 2 + (seq - window) * window) / causal


def executed_flops(kernel: str, seq: int, window: int | None, target: str) -> float:
    device = gpu_target.devices(target, 1)[0]
    sharding = SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq, KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=sharding)
    attend = {"flash": lambda q, k, v: flash_attention(q, k, v, True, window=window),
              "cudnn": lambda q, k, v: cudnn_attention(q, k, v, True, window=window)}[kernel]
    grad = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
    compiled = jax.jit(grad).lower(q, kv, kv).compile(dict(gpu_target.COMPILER_OPTIONS))
    # Causal loops end at the diagonal, a trip count the compiler cannot know: over n
    # tiles they run (n + 1) / 2 times on average (forward and backward alike).
    causal_trips = (seq // Q_TILE + 1) / 2
    return gpu_report.report(compiled.as_text(), build_mesh("dp=1", [device]),
                             unknown_trips=causal_trips).executed_flops


def rows(seq: int, target: str) -> list[dict]:
    out = []
    for kernel in ("flash", "cudnn"):
        causal = None
        for window in WINDOWS:
            flops = executed_flops(kernel, seq, window, target)
            causal = causal or flops
            out.append({"kernel": kernel, "seq_len": seq, "window": window,
                        "executed_tflop": flops / 1e12, "x_causal": flops / causal,
                        "window_share": pairs_kept(seq, window)})
    return out


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    parser.add_argument("--seq-len", type=int, default=32768)
    args = parser.parse_args()
    gpu_target.check_plugin()
    result = {"target": args.target, "compiler": f"XLA's GPU compiler for {args.target}",
              "rows": rows(args.seq_len, args.target)}
    columns = [Column("kernel", "7"), Column("tokens", ">7", "seq_len"),
               Column("window", ">7", lambda r: str(r["window"] or "-")),
               Column("TFLOP", ">8.3f", "executed_tflop"),
               Column("x causal", ">9.3f", "x_causal"),
               Column("window share", ">13.3f", "window_share")]
    common.emit(result, args.json, lambda: [*common.table(result["rows"], columns),
                                            result["compiler"] + ", forward + backward"])


if __name__ == "__main__":
    main()
