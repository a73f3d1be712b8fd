"""The grouped experts' matmuls as a loop of XLA matmuls or as Pallas kernels
(`--expert-matmul loop|kernel`), from the GPU compiler (deviceless, `--target`): one
Qwen3-30B-A3B MoE layer (128 experts, top-8, d 2048, f 768, bf16) on 8 GPUs with ep=8,
4096 tokens per device (the issue's 8 x 4096 batch), grouped routing, its exchanges in
`OVERLAP_PIECES` pieces (the GPU default), forward and backward per device:

  matmul ops   matmul executions (gpu_report: dots, cuBLAS calls, matmul kernels; loops
               counted by their trip counts; the later rounds' loop 0 times: near balance)
  TFLOP        their executed FLOPs (the kernels' from their metadata), the router's in
  peak GiB     compiled arguments + outputs + temporaries (`jdist.memory.peak`)

Then (`--step`, a few minutes per compile on 2 cores) the whole training step of
Qwen3-30B-A3B with 2 layers, ep=8, 8 x 4096 tokens, `--remat none`, GPU defaults
(`--moe-overlap` on): the same, and the share of the all-to-all bytes left exposed (first
rounds; `benchmarks/moe_at_scale.py`).

Compile only: nothing runs, so no timings; and XLA's cost analysis ("bytes accessed")
returns nothing for these deviceless compiles (jax 0.10.2), so no bytes either.

    python benchmarks/grouped_gemm.py [--json] [--target h100-80gb] [--tokens 4096] [--step]
"""

from __future__ import annotations

import common
import expert_matmuls
from common import Column

common.setup_devices(8, cpu_only=True)

COLUMNS = (Column("matmul", "7"), Column("matmul ops", "11.0f", "gemms"),
           Column("TFLOP", "8.3f", "tflop"), Column("peak GiB", "9.2f", "peak_gib"),
           Column("compile s", "10.1f", "compile_s"))
STEP = (*COLUMNS[:4], Column("a2a exposed", "12.1%", "a2a_exposed"))


def measure(target: str, tokens: int, n_ep: int = 8) -> list[dict]:
    import dataclasses
    import time

    import jax
    import jax.numpy as jnp

    from jdist.memory import peak
    from jdist.models import get_preset
    from jdist.models.grouped_kernel import Kernel
    from jdist.parallel.moe import OVERLAP_PIECES, moe_ffn
    from jdist.runtime.target import COMPILER_OPTIONS
    from jdist.spmd.rules import DEFAULT_RULES
    from jdist.tools import gpu_report

    mesh, x, w = expert_matmuls.ep_layer("qwen3-30b-a3b", target, n_ep, tokens)
    cfg = dataclasses.replace(get_preset("qwen3-30b-a3b"), moe_routing="grouped")
    rows = []
    for name, kernel in (("loop", None), ("kernel", Kernel(interpret=False, required=True))):
        layer = lambda x, w, kernel=kernel: moe_ffn(x, w, cfg, mesh=mesh, rules=DEFAULT_RULES,
                                                    pieces=OVERLAP_PIECES,
                                                    gmm_kernel=kernel)[0]
        loss = lambda x, w, layer=layer: jnp.sum(layer(x, w).astype(jnp.float32) ** 2)
        start = time.perf_counter()
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile(
            dict(COMPILER_OPTIONS))
        seconds = time.perf_counter() - start
        rep = gpu_report.report(compiled.as_text(), mesh, unknown_trips=0)
        rows.append({"matmul": name, "gemms": rep.gemms, "tflop": rep.executed_flops / 1e12,
                     "peak_gib": peak(compiled) / 2**30, "compile_s": seconds,
                     "tokens_per_device": tokens, "n_ep": n_ep})
    return rows


def measure_step(target: str) -> list[dict]:
    """The 2-layer step on ep=8 under each `--expert-matmul`."""
    import time

    from jdist.config import parse_args
    from jdist.memory import compile_step, peak
    from jdist.step.from_flags import plan_for
    from jdist.tools import gpu_report

    rows = []
    for name in ("loop", "kernel"):
        config = parse_args(["--model", "qwen3-30b-a3b", "--n-layers", "2", "--batch-size", "8",
                             "--seq-len", "4096", "--compute-dtype", "bfloat16", "--target",
                             target, "--mesh", "ep=8", "--remat", "none", "--moe-routing",
                             "grouped", "--expert-matmul", name])
        _, plan, _ = plan_for(config)
        start = time.perf_counter()
        step = compile_step(plan, 8, 4096)
        rep = gpu_report.report(step.as_text(), plan.mesh, unknown_trips=0)
        a2a = [r for r in rep.rows if r.kind == "all-to-all"]
        rows.append({"matmul": name, "gemms": rep.gemms, "tflop": rep.executed_flops / 1e12,
                     "peak_gib": peak(step) / 2**30, "a2a_exposed": a2a[0].exposed,
                     "compile_s": time.perf_counter() - start})
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    parser.add_argument("--step", action="store_true", help="also the whole 2-layer step")
    args = parser.parse_args()
    from jdist.runtime.target import prepare_target

    prepare_target(args.target)
    rows = measure(args.target, args.tokens)
    steps = measure_step(args.target) if args.step else []
    common.emit({"layer": rows, "step": steps}, args.json, lambda: [
        f"one Qwen3-30B-A3B MoE layer, ep=8, {args.tokens} tokens per device, forward + "
        f"backward, {args.target} compiler:", *common.table(rows, COLUMNS),
        *(["\nthe 2-layer step, ep=8, 8 x 4096, --remat none:", *common.table(steps, STEP)]
          if steps else [])])


if __name__ == "__main__":
    main()
