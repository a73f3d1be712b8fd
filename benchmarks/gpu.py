"""Training throughput on one accelerator: tokens/s, TFLOP/s, MFU, peak memory, compile time,
for each attention implementation that can run.

    python benchmarks/gpu.py [--json] [--models llama3.2-1b,llama3-8b] [--budget-s 420]
    python benchmarks/gpu.py --fp8 rowwise [--json]  # bf16 against FP8, one attention
    python benchmarks/gpu.py --tiny [--json]     # CPU: the same path on the tiny model

On a GPU: `llama3.2-1b` and `llama3-8b` in bfloat16, full remat, one device. Each
configuration is compiled ahead of time first; if the compiled step's peak exceeds the
device's memory the model is cut to fewer layers until it fits (the row says so; per-layer
throughput is what MFU measures). MFU is against the bf16 matmul peak *measured* here (a
large matmul timed on the device), and against the datasheet peak where known. Rows stop
being started once `--budget-s` has passed, so the whole run stays inside its time limit.

With `--fp8 tensorwise|rowwise`, each model runs twice with the best attention that can run
(cuDNN, else flash): in bf16 (float32 on a CPU) and with `--fp8` (jdist.quant.fp8), and the
table's last lines give FP8's tokens/s over bf16's, measured on the same number of layers.
"""

from __future__ import annotations

import dataclasses
import math
import time

import common
import jax
import jax.numpy as jnp
from common import Column, GiB

from jdist import data
from jdist.config.groups import MemoryFlags
from jdist.memory import peak as peak_bytes
from jdist.models import get_preset
from jdist.parallel.attention import CUDNN, FLASH, XLA, accelerator, cudnn_refusal
from jdist.spmd.mesh import build_mesh
from jdist.spmd.rules import DEFAULT_RULES
from jdist.step import init_state, make_optimizer, make_plan
from jdist.step.build import make_train_step
from jdist.tools.throughput import PEAK_TFLOPS, flops_per_token, peak_tflops

GPU_RUNS = {"llama3.2-1b": (8, 4096), "llama3-8b": (1, 4096)}  # batch, sequence length
TINY_RUNS = {"tiny": (4, 64)}
COLUMNS = (Column("model", "14"),
           Column("layers", ">7", lambda r: f"{r['layers']:>3}/{r['of_layers']:<3}"),
           Column("attention", "9"), Column("fp8", "10"),
           Column("tokens/s", "10,.0f", "tokens_per_s"),
           Column("TFLOP/s", "8.2f", "tflops_per_device"),
           Column("MFU", "6.1%", "mfu_measured_peak"),
           Column("peak GiB", "9.2f", "compiled_peak_bytes", GiB),
           Column("compile s", "9.1f", "compile_s"))


def measured_peak_tflops(dtype, n: int, repeats: int) -> float:
    """bf16 (or the run's dtype) matmul throughput of this device: the MFU denominator."""
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a)
    out.block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def attention_errors(dtype) -> dict[str, float]:
    """Max relative error (output and dq, dk, dv) of each runnable attention against the
    dense float32 reference, on 8B-shaped heads (GQA 32/8, head_dim 128), causal."""
    from jdist.models.layers import dot_product_attention
    from jdist.parallel.attention import cudnn_attention
    from jdist.parallel.attention.flash import flash_attention

    keys = jax.random.split(jax.random.key(0), 4)
    s = 64 if jax.default_backend() == "cpu" else 2048
    shapes = ((1, s, 32, 128), (1, s, 8, 128), (1, s, 8, 128), (1, s, 32, 128))
    q, k, v, ct = (jax.random.normal(key, shape) for key, shape in zip(keys, shapes))

    def out_and_grads(attend, cast):
        def f(q, k, v):
            out = attend(*(x.astype(cast) for x in (q, k, v))).astype(jnp.float32)
            return jnp.sum(out * ct), out
        (_, out), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(q, k, v)
        return [out, *grads]

    with jax.default_matmul_precision("highest"):
        ref = out_and_grads(lambda q, k, v: dot_product_attention(q, k, v, True), jnp.float32)
    kernels = {FLASH: flash_attention, XLA: dot_product_attention, CUDNN: cudnn_attention}
    errors = {}
    for name in attentions(dtype, 128):
        got = out_and_grads(lambda q, k, v, f=kernels[name]: f(q, k, v, True), dtype)
        errors[name] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                           for a, b in zip(got, ref))
    return errors


def compiled_step(model, batch: int, seq: int, attention: str, dtype, fp8: str = "off"):
    tx, schedule = make_optimizer(1e-4, 100, 10)
    mesh = build_mesh("dp=1", jax.devices()[:1])
    memory = MemoryFlags(compute_dtype=jnp.dtype(dtype).name, remat="full", attention=attention,
                         fp8=fp8)
    plan = make_plan(model, mesh, DEFAULT_RULES, tx, memory)
    step = make_train_step(plan, schedule)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    start = time.perf_counter()
    compiled = step.lower(plan.abstract, {"inputs": tokens, "targets": tokens}).compile()
    return plan, compiled, time.perf_counter() - start


def device_memory() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit", 0)


FITS: dict[str, int] = {}  # layers of each model that fit, found by its first row


def run_one(name: str, batch: int, seq: int, attention: str, dtype, steps: int,
            fp8: str = "off") -> dict:
    model = get_preset(name)
    if name in FITS:
        model = dataclasses.replace(model, n_layers=FITS[name])
    limit = device_memory()
    while True:
        plan, compiled, compile_s = compiled_step(model, batch, seq, attention, dtype, fp8)
        peak = peak_bytes(compiled)
        if not limit or peak <= 0.95 * limit or model.n_layers <= 1:
            break
        model = dataclasses.replace(model, n_layers=model.n_layers // 2)  # halve until it fits
    FITS.setdefault(name, model.n_layers)
    state = init_state(plan, seed=0)
    corpus = data.load_corpus(None, seq)
    batches = [data.global_batch(corpus.train, 0, i, batch, seq, plan.batch_sharding)
               for i in range(2)]
    state, metrics, elapsed = common.time_steps(compiled, state, batches, steps)
    loss = float(metrics["loss"])
    tokens_per_s = batch * seq * steps / elapsed
    tflops = tokens_per_s * flops_per_token(model, seq) / 1e12
    used = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    return {"model": name, "layers": model.n_layers, "of_layers": get_preset(name).n_layers,
            "attention": attention, "fp8": fp8, "batch": batch, "seq_len": seq, "steps": steps,
            "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
            # The device's high-water mark since the process started (all rows so far).
            "compiled_peak_bytes": peak, "device_peak_bytes_so_far": used, "compile_s": compile_s,
            "final_loss": loss, "loss_finite": math.isfinite(loss)}


def attentions(dtype, head_dim: int) -> list[str]:
    runnable = [XLA, FLASH]
    if cudnn_refusal(*accelerator()[:1], dtype, head_dim, accelerator()[1]) is None:
        runnable.append(CUDNN)
    return runnable


def variants(dtype, head_dim: int, fp8: str) -> list[tuple[str, str]]:
    """(attention, --fp8) per row: every attention in bf16, or with `fp8` on the best
    attention only, without FP8 and with it."""
    runnable = attentions(dtype, head_dim)
    if fp8 == "off":
        return [(a, "off") for a in runnable]
    return [(runnable[-1], "off"), (runnable[-1], fp8)]


def fp8_speedups(rows: list[dict]) -> dict:
    """Per model, FP8's tokens/s over the compute dtype's where both ran on the same
    layers."""
    out = {}
    for row in rows:
        if row["fp8"] == "off":
            continue
        base = next((r for r in rows if r["model"] == row["model"] and r["fp8"] == "off"
                     and r["attention"] == row["attention"] and r["layers"] == row["layers"]),
                    None)
        if base:
            out[row["model"]] = {"fp8": row["fp8"],
                                 "ratio": row["tokens_per_s"] / base["tokens_per_s"]}
    return out


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--tiny", action="store_true", help="CPU: the tiny model, few steps")
    parser.add_argument("--models", default="", help="comma-separated presets")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--fp8", choices=("off", "tensorwise", "rowwise"), default="off",
                        help="also run each model with --fp8 MODE (one attention)")
    args = parser.parse_args()
    runs = TINY_RUNS if args.tiny or jax.default_backend() == "cpu" else GPU_RUNS
    if args.models:
        runs = {m: runs.get(m, (1, 4096)) for m in args.models.split(",")}
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    steps = args.steps or (3 if jax.default_backend() == "cpu" else 20)
    n = 1024 if jax.default_backend() == "cpu" else 8192
    measured = measured_peak_tflops(dtype, n, 3 if jax.default_backend() == "cpu" else 50)
    kind = jax.devices()[0].device_kind
    datasheet = peak_tflops(kind)
    errors = attention_errors(dtype)
    began, rows, skipped = time.perf_counter(), [], []
    for name, (batch, seq) in runs.items():
        for attention, fp8 in variants(dtype, get_preset(name).dim_per_head, args.fp8):
            if time.perf_counter() - began > args.budget_s:
                skipped.append(f"{name}/{attention}/{fp8}")
                continue
            row = run_one(name, batch, seq, attention, dtype, steps, fp8)
            row["mfu_measured_peak"] = row["tflops_per_device"] / measured
            row["mfu_datasheet"] = row["tflops_per_device"] / datasheet if datasheet else None
            rows.append(row)
    result = {"device": kind, "backend": jax.default_backend(), "dtype": jnp.dtype(dtype).name,
              "measured_matmul_tflops": measured, "datasheet_tflops": datasheet or None,
              "known_peaks": PEAK_TFLOPS, "attention_max_rel_error_vs_f32_dense": errors,
              "rows": rows, "skipped_for_time": skipped, "fp8_speedup": fp8_speedups(rows)}
    common.emit(result, args.json, lambda: [
        f"{kind} ({jax.default_backend()}, {result['dtype']}): measured matmul peak "
        f"{measured:,.1f} TFLOP/s" + (f", datasheet {datasheet:,.0f}" if datasheet else ""),
        *common.table(rows, COLUMNS),
        "attention vs float32 dense (output, dq, dk, dv; max relative error): "
        + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
        *[f"{m}: FP8 {r['fp8']} tokens/s over {result['dtype']}'s: {r['ratio']:.3f}"
          for m, r in result["fp8_speedup"].items()],
        *([f"not run (time budget): {', '.join(skipped)}"] if skipped else [])], indent=2)


if __name__ == "__main__":
    main()
