"""Per-device memory of fine-tuning: full training vs LoRA vs QLoRA (NF4, with and without
double quantization), from the planner (`jdist.memory.predict`) and, with `--measure`, from
the step compiled ahead of time on abstract inputs (nothing is allocated).

    python benchmarks/finetune_memory.py [--models llama3.2-1b,llama3.1-8b,llama3.1-70b]
        [--rank 16] [--seq-len 2048] [--measure] [--json]

Every row is one device (mesh dp=1), batch 1, full remat, bfloat16 compute. Targets (issue
14): the 70B QLoRA row with double quantization at most 46 GiB; LoRA's optimizer state the
adapters' only (2 float32 moments per adapter weight). On the CPU backend a measured bf16
step is larger than on an accelerator: XLA's CPU compiler widens bf16 matmul operands to
float32 (see the closing note of issue 14).
"""

from __future__ import annotations

import argparse
import json

from jdist.memory import measure, predict
from jdist.train.config import TrainConfig
from jdist.train.setup import plan_for

VARIANTS = {"full": {}, "lora": {"lora_rank": True},
            "qlora": {"lora_rank": True, "quantize_base": "nf4"},
            "qlora+dq": {"lora_rank": True, "quantize_base": "nf4", "double_quant": True}}
GIB = 2**30


def row(model: str, variant: str, rank: int, seq_len: int, do_measure: bool) -> dict:
    flags = {k: (rank if v is True else v) for k, v in VARIANTS[variant].items()}
    config = TrainConfig(model=model, mesh="dp=1", batch_size=1, seq_len=seq_len,
                         remat="full", compute_dtype="bfloat16", **flags)
    _, plan, _ = plan_for(config)
    out = {"model": model, "variant": variant,
           "predicted": {k: v / GIB for k, v in predict(plan, 1, seq_len).as_dict().items()}}
    if do_measure:
        out["measured"] = {k: v / GIB for k, v in measure(plan, 1, seq_len).as_dict().items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3.2-1b,llama3.1-8b,llama3.1-70b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--measure", action="store_true", help="also compile each step (AOT)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [row(m, v, args.rank, args.seq_len, args.measure)
            for m in args.models.split(",") for v in VARIANTS]
    if args.json:
        print(json.dumps({"rank": args.rank, "seq_len": args.seq_len, "rows": rows}))
        return
    keys = ("params", "grads", "optimizer", "activations", "total")
    print(f"{'model':14} {'variant':9} " + " ".join(f"{k:>11}" for k in keys)
          + ("   measured total" if args.measure else "") + "   (GiB per device)")
    for r in rows:
        p = r["predicted"]
        line = f"{r['model']:14} {r['variant']:9} " + " ".join(f"{p[k]:11.3f}" for k in keys)
        if "measured" in r:
            line += f"   {r['measured']['total']:14.3f}"
        print(line)


if __name__ == "__main__":
    main()
