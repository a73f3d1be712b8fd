"""Per-device memory of fine-tuning: full training vs LoRA vs QLoRA (NF4, with and without
double quantization), from the planner (`jdist.memory.predict`) and, with `--measure`, from
the step compiled ahead of time on abstract inputs (nothing is allocated).

    python benchmarks/finetune_memory.py [--models llama3.2-1b,llama3.1-8b,llama3.1-70b]
        [--rank 16] [--seq-len 2048] [--measure] [--target h100-80gb|none] [--json]

Every row is one device (mesh dp=1), batch 1, full remat, bfloat16 compute. Targets (issue
14): the 70B QLoRA row with double quantization at most 46 GiB; LoRA's optimizer state the
adapters' only (2 float32 moments per adapter weight).

Columns by source: the breakdown (params ... total) is the planner's; `CPU act` /
`CPU peak` come from XLA's CPU compiler (`--measure`); `GPU act` / `GPU peak` from XLA's
GPU compiler for `--target` (`jdist.runtime.target`: compile-only GPUs, nothing run), with
`--measure` (default target `h100-80gb` where jax's CUDA plugin is installed; `--target none`
skips it) or when `--target` is given alone (then without the slow CPU compiles). `act` is
the activations of `jdist.memory.measure`'s breakdown (the step's temporaries less the
gradients; the state, parameters + gradients + optimizer, comes out as the planner's on
both compilers; JSON has each whole breakdown); `peak` is arguments + unaliased outputs +
temporaries, which for these donated steps is the breakdown's total. The CPU backend widens
bf16 buffers (matmul operands among them: a LoRA step's CPU activations hold about its
frozen bf16 base again in float32) to float32, so its bf16 step is larger than what a GPU
allocates (see the closing note of issue 14).
Attention is `auto` on both: flash on the CPU, cuDNN's fused kernel on the GPU (bfloat16,
compute capability 8.0+).
"""

from __future__ import annotations

import common
from common import Column, GiB

from jdist.config import TrainConfig
from jdist.memory import compile_step, measure, peak, predict
from jdist.step.forward import attention_of
from jdist.step.from_flags import plan_for

VARIANTS = {"full": {}, "lora": {"lora_rank": True},
            "qlora": {"lora_rank": True, "quantize_base": "nf4"},
            "qlora+dq": {"lora_rank": True, "quantize_base": "nf4", "double_quant": True}}
KEYS = ("params", "grads", "optimizer", "activations", "total")


def compiled_numbers(plan, seq_len: int) -> dict:
    """The compiler's breakdown (GiB) and peak (GiB) of the step on `plan`'s devices."""
    compiled = compile_step(plan, 1, seq_len)
    breakdown = measure(plan, 1, seq_len, compiled)
    return {"attention": attention_of(plan, seq_len),
            "measured": {k: v / GiB for k, v in breakdown.as_dict().items()},
            "peak": peak(compiled) / GiB}


def row(model: str, variant: str, rank: int, seq_len: int, do_measure: bool,
        target: str = "") -> dict:
    flags = {k: (rank if v is True else v) for k, v in VARIANTS[variant].items()}
    config = TrainConfig.of(model=model, mesh="dp=1", batch_size=1, seq_len=seq_len,
                            remat="full", compute_dtype="bfloat16", **flags)
    _, plan, _ = plan_for(config)
    out = {"model": model, "variant": variant,
           "predicted": {k: v / GiB for k, v in predict(plan, 1, seq_len).as_dict().items()}}
    if do_measure:
        numbers = compiled_numbers(plan, seq_len)
        out["measured"], out["measured_peak"] = numbers["measured"], numbers["peak"]
        out["attention"] = numbers["attention"]
    if target:
        config = config.replace(target=target)
        _, plan, _ = plan_for(config)
        out["gpu"] = {"target": target, **compiled_numbers(plan, seq_len),
                      "predicted": {k: v / GiB for k, v in
                                    predict(plan, 1, seq_len).as_dict().items()}}
    return out


def columns(measured: bool, target: str) -> list[Column]:
    cpu = [Column("CPU act", "9.3f", lambda r: r["measured"]["activations"]),
           Column("CPU peak", "9.3f", "measured_peak")]
    gpu = [Column("GPU pred", "9.3f", lambda r: r["gpu"]["predicted"]["total"]),
           Column("GPU act", "9.3f", lambda r: r["gpu"]["measured"]["activations"]),
           Column("GPU peak", "9.3f", lambda r: r["gpu"]["peak"])]
    return [Column("model", "14"), Column("variant", "9"),
            *(Column(k, "11.3f", lambda r, k=k: r["predicted"][k]) for k in KEYS),
            *(cpu if measured else []), *(gpu if target else [])]


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--models", default="llama3.2-1b,llama3.1-8b,llama3.1-70b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--measure", action="store_true",
                        help="also compile each step (AOT) on the CPU and for --target")
    common.add_target(parser, "compile each step for this GPU",
                      "default with --measure: h100-80gb where jax's CUDA plugin is installed",
                      "no GPU compile")
    args = parser.parse_args()
    target = common.requested_target(parser, args, args.measure)
    rows = [row(m, v, args.rank, args.seq_len, args.measure, target)
            for m in args.models.split(",") for v in VARIANTS]
    common.emit({"rank": args.rank, "seq_len": args.seq_len, "target": target or None,
                 "rows": rows}, args.json, lambda: text(rows, args.measure, target))


def text(rows: list[dict], measured: bool, target: str) -> list[str]:
    head, *lines = common.table(rows, columns(measured, target))
    used = [f"CPU: XLA's CPU compiler, {rows[0]['attention']} attention"] if measured else []
    used += [f"GPU: XLA's GPU compiler for {target}, {rows[0]['gpu']['attention']} "
             "attention"] if target else []
    return [head + "   (GiB per device)", *lines] + [
        "predicted: jdist.memory.predict of the CPU plan (GPU pred: of the target's "
        "plan, cuDNN attention); " + "; ".join(used)] * bool(used)


if __name__ == "__main__":
    main()
