"""Memory of the real-scale compute path, from compiled programs (deterministic, ahead of time):
attention and loss alone, and the whole Llama-3-8B step, flash/chunked beside xla/full.

Two compilers: `CPU temps` / `CPU peak` come from XLA's CPU compiler (8 simulated devices);
`GPU temps` / `GPU peak` from XLA's GPU compiler for `--target` (default `h100-80gb` where
jax's CUDA plugin is installed; `--target none` skips it), the same programs compiled for
compile-only GPUs (`jdist.runtime.target`), nothing run. `predicted` is the planner's step total
(`jdist.memory.predict`). Everything computes in bfloat16, which the CPU backend widens to
float32 in many buffers: its numbers overstate what a GPU allocates. cuDNN attention
(bfloat16 only) exists only on the GPU: its rows have no CPU column.

    python benchmarks/compute_path.py [--json] [--skip-steps] [--target h100-80gb|none]

Targets (issue 12):
  - `llama3-8b`, fsdp=8, ZeRO-3, 8 x 8192 tokens, full remat, bf16, flash attention and the
    chunked loss: compiled step peak <= 24 GiB per device;
  - with flash, the step's temporaries at 16384 tokens <= 2.3 x those at 8192 (linear);
  - the loss's temporaries (forward + backward) <= 10% of the float32 logits' bytes.
Each target is checked on each compiler's numbers.
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(8, cpu_only=True)  # AOT on CPU devices, on any host

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

from jdist.config import TrainConfig
from jdist.memory import compile_step, peak, predict
from jdist.models import get_preset
from jdist.models.layers import dot_product_attention
from jdist.models.loss import cross_entropy
from jdist.parallel.attention import cudnn_attention
from jdist.parallel.attention.flash import flash_attention
from jdist.parallel.vocab import vocab_parallel_cross_entropy
from jdist.runtime import target as gpu_target
from jdist.spmd.mesh import build_mesh
from jdist.step.from_flags import plan_for

MODEL = "llama3-8b"
BF16 = jnp.bfloat16


def device_of(target: str):
    """One device to compile a single-device program for: the CPU's, or a compile-only GPU."""
    return gpu_target.devices(target, 1)[0] if target else jax.devices()[0]


def temp_bytes(fn, *shapes) -> int:
    """Temporaries of `fn` compiled for the device the shapes are placed on."""
    device = next(iter(shapes[0].sharding.device_set))
    options = gpu_target.COMPILER_OPTIONS if gpu_target.is_compile_only(device) else None
    return common.temp_bytes(jax.jit(fn).lower(*shapes).compile(options))


def attention_rows(target: str = "") -> list[dict]:
    """One layer's attention, forward and backward, one 8B sequence on one device: on the
    CPU, and on the GPU (where cuDNN's fused kernel joins)."""
    cfg = get_preset(MODEL)
    rows = []
    for seq in (8192, 16384):
        impls = [("xla", dot_product_attention), ("flash", flash_attention)]
        for name, attend in impls + ([("cudnn", cudnn_attention)] if target else []):
            grad = jax.grad(lambda q, k, v, f=attend: f(q, k, v, True).astype(jnp.float32).sum(),
                            (0, 1, 2))
            row = {"what": "attention", "impl": name, "seq_len": seq, "temp_bytes": None}
            for where in ("",) * (name != "cudnn") + ((target,) if target else ()):
                sharding = SingleDeviceSharding(device_of(where))
                q = jax.ShapeDtypeStruct((1, seq, cfg.n_heads, cfg.dim_per_head), BF16,
                                         sharding=sharding)
                kv = jax.ShapeDtypeStruct((1, seq, cfg.n_kv_heads, cfg.dim_per_head), BF16,
                                          sharding=sharding)
                temps = temp_bytes(grad, q, kv, kv)
                if where:
                    row["gpu"] = {"target": where, "temp_bytes": temps}
                else:
                    row["temp_bytes"] = temps
            rows.append(row)
    return rows


def loss_rows(target: str = "") -> list[dict]:
    """The loss of one 8B sequence (8192 tokens, vocab 128256) with its gradients, from the
    float32 master weight and bf16 hidden states, as the step runs it (the full loss casts
    the weight to bf16 for its matmul; the chunked one casts a chunk at a time)."""
    rows = [loss_row(name, "") for name in ("full", "chunked")]
    for row in rows if target else []:
        row["gpu"] = {"target": target,
                      "temp_bytes": loss_row(row["impl"], target)["temp_bytes"]}
    return rows


def loss_row(name: str, target: str) -> dict:
    cfg = get_preset(MODEL)
    device = device_of(target)
    mesh = build_mesh("dp=1", [device])
    sharding = SingleDeviceSharding(device)
    tokens = 8192
    h = jax.ShapeDtypeStruct((1, tokens, cfg.d_model), BF16, sharding=sharding)
    w = jax.ShapeDtypeStruct((cfg.d_model, cfg.vocab_size), jnp.float32, sharding=sharding)
    labels = jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=sharding)

    def full(h, w, labels):
        return cross_entropy(jnp.einsum("bse,ev->bsv", h, w.astype(BF16)), labels).sum()

    def chunked(h, w, labels):
        return vocab_parallel_cross_entropy(h, w, labels, vocab_dim=1, mesh=mesh, h_spec=P(),
                                            w_spec=P(), label_spec=P()).sum()

    fn = {"full": full, "chunked": chunked}[name]
    return {"what": "loss", "impl": name, "seq_len": tokens,
            "temp_bytes": temp_bytes(jax.grad(fn, (0, 1)), h, w, labels),
            "f32_logits_bytes": tokens * cfg.vocab_size * 4}


# (tokens, attention, loss, on the CPU too): cuDNN attention compiles for the GPU only.
STEPS = ((8192, "flash", "chunked", True), (16384, "flash", "chunked", True),
         (8192, "xla", "full", True), (8192, "cudnn", "chunked", False),
         (16384, "cudnn", "chunked", False))


def step_rows(target: str = "") -> list[dict]:
    rows = []
    for seq, attention, loss, on_cpu in STEPS:
        if not on_cpu and not target:
            continue
        row = {"what": "step", "impl": f"{attention}+{loss}", "seq_len": seq,
               "temp_bytes": None}
        for where in ("",) * on_cpu + ((target,) if target else ()):
            config = TrainConfig.of(model=MODEL, mesh="fsdp=8", zero=3, batch_size=8,
                                    seq_len=seq, remat="full", compute_dtype="bfloat16",
                                    attention=attention, loss=loss, target=where)
            _, plan, _ = plan_for(config)
            compiled = compile_step(plan, config.data.batch_size, seq)
            numbers = {"peak_bytes": peak(compiled),
                       "temp_bytes": common.temp_bytes(compiled)}
            row["predicted_bytes"] = predict(plan, config.data.batch_size, seq).total
            if where:
                row["gpu"] = {"target": where, **numbers}
            else:
                row.update(numbers)
        rows.append(row)
    return rows


def checks(rows: list[dict]) -> list[str]:
    """The issue's targets on the CPU's numbers, then on the GPU's."""
    out = []
    by = {(r["what"], r["impl"], r["seq_len"]): r for r in rows}
    compilers = [("CPU", lambda r: r)]
    if "gpu" in by[("loss", "chunked", 8192)]:
        compilers.append((by[("loss", "chunked", 8192)]["gpu"]["target"], lambda r: r["gpu"]))
    for where, numbers in compilers:
        chunked = by[("loss", "chunked", 8192)]
        share = numbers(chunked)["temp_bytes"] / chunked["f32_logits_bytes"]
        out.append(f"{where}: loss temporaries {share:.1%} of the f32 logits (target <= 10%): "
                   f"{'ok' if share <= 0.10 else 'MISSED'}")
        if ("step", "flash+chunked", 8192) in by:
            s8 = numbers(by[("step", "flash+chunked", 8192)])
            s16 = numbers(by[("step", "flash+chunked", 16384)])
            gib = s8["peak_bytes"] / 2**30
            out.append(f"{where}: 8B 8x8192 step peak {gib:.2f} GiB (target <= 24): "
                       f"{'ok' if gib <= 24 else 'MISSED'}")
            ratio = s16["temp_bytes"] / s8["temp_bytes"]
            out.append(f"{where}: step temporaries 16384 / 8192 tokens = {ratio:.2f} (target "
                       f"<= 2.3): {'ok' if ratio <= 2.3 else 'MISSED'}")
    return out


def columns(target: str) -> list[Column]:
    def gib(get):
        return lambda r: f"{get(r) / 2**30:9.3f}G" if get(r) is not None else "-"

    gpu = [Column("GPU temps", ">10", gib(lambda r: r.get("gpu", {}).get("temp_bytes"))),
           Column("GPU peak", ">10", gib(lambda r: r.get("gpu", {}).get("peak_bytes")))]
    return [Column("what", "10"), Column("impl", "14"), Column("tokens", ">7", "seq_len"),
            Column("CPU temps", ">10", gib(lambda r: r["temp_bytes"])),
            Column("CPU peak", ">10", gib(lambda r: r.get("peak_bytes"))),
            Column("predicted", ">10", gib(lambda r: r.get("predicted_bytes"))),
            *(gpu if target else [])]


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--skip-steps", action="store_true",
                        help="only attention and loss (the whole-step compiles take minutes)")
    common.add_target(parser, "also compile for this GPU")
    args = parser.parse_args()
    target = common.requested_target(parser, args)
    rows = attention_rows(target) + loss_rows(target) + \
        ([] if args.skip_steps else step_rows(target))
    result = {"target": target or None, "rows": rows, "checks": checks(rows)}
    head, *lines = common.table(rows, columns(target))
    note = [f"CPU: XLA's CPU compiler; GPU: XLA's GPU compiler for {target}; predicted: "
            "jdist.memory.predict (steps)"] * bool(target)
    common.emit(result, args.json, lambda: [head + "   (per device)", *lines, *note,
                                            *result["checks"]], indent=2)


if __name__ == "__main__":
    main()
