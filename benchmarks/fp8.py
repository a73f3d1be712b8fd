"""FP8 numerics against bf16: loss curves and first-step gradients of `--fp8` training.

    python benchmarks/fp8.py [--steps 300] [--steps-1b 20] [--batch-size 8] [--seq-len 128]
                             [--json]

Trains `small` for `--steps` steps on the built-in corpus in bf16 and in each `--fp8` mode
(same seed, batches and AdamW schedule; one CPU device), and a 4-layer llama3.2-1b-shaped
model (byte vocabulary) for `--steps-1b` steps. Per run: the final loss (the mean of the last
tenth of the steps) relative to bf16's, whether any step's loss or gradient norm was not
finite, and per block projection the first step's gradient error against bf16's (the
largest difference over the bf16 gradient's largest magnitude). Checks, per FP8 run: final
loss within 2% of bf16's, every step finite, and every projection's gradient error under
25% (an e5m2 cotangent keeps 2 mantissa bits: a rounding moves an element by at most
12.5%). A `sabotaged` row trains rowwise with every scale inverted (the bug of dividing where
one should multiply) and must fail them: the script exits 1 if a real mode fails or the
sabotage passes. CPU numbers (XLA CPU computes the float8 products exactly, with a float32
accumulator, as the GPU's FP8 gemm does; jax 0.10.2).
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(1)

import contextlib
import sys

import numpy as np

from jdist import data
from jdist.models import get_preset
from jdist.quant import fp8
from jdist.tools.equivalence import config, train_steps

PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MODES = (("bf16", "off", False), ("tensorwise", "tensorwise", False),
         ("rowwise", "rowwise", False), ("sabotaged", "rowwise", True))
LOSS_RTOL, GRAD_RTOL = 0.02, 0.25
COLUMNS = (Column("model", "10"), Column("run", "11"), Column("steps", ">5"),
           Column("final loss", ">10.4f", "final_loss"),
           Column("vs bf16", ">8.2%", "loss_diff"),
           Column("finite", ">6", lambda r: "yes" if r["finite"] else "NO"),
           *(Column(p, ">7", lambda r, p=p: f"{r['grad_error'][p]:.1%}"
                    if p in r["grad_error"] else "") for p in PROJECTIONS),
           Column("checks", ">7"))


@contextlib.contextmanager
def inverted_scales():
    """Every FP8 scale replaced by its inverse (`benchmarks/fp8.py`'s sabotage)."""
    original = fp8.scale_of
    fp8.scale_of = lambda *a, **k: 1.0 / original(*a, **k)
    try:
        yield
    finally:
        fp8.scale_of = original


def leaf_errors(grads: dict, reference: dict) -> dict[str, float]:
    """Per projection: max |g - ref| / max |ref| over the stacked layers."""
    out = {}
    blocks, ref_blocks = grads["blocks"], reference["blocks"]
    for part in blocks:
        for name, g in blocks[part].items():
            if name in PROJECTIONS and isinstance(g, np.ndarray):
                ref = ref_blocks[part][name]
                out[name] = float(np.abs(g - ref).max() / max(np.abs(ref).max(), 1e-30))
    return out


def run_model(label: str, model, steps: int, batch_size: int, seq_len: int, tokens) -> list:
    rows, reference = [], None
    for run, mode, sabotage in MODES:
        flags = config(steps=steps, batch_size=batch_size, seq_len=seq_len,
                       compute_dtype="bfloat16", fp8=mode, lr=1e-3, attention="xla")
        with inverted_scales() if sabotage else contextlib.nullcontext():
            result = train_steps(model, "dp=1", tokens, flags)
        tail = max(1, steps // 10)
        final = float(np.mean(result.losses[-tail:]))
        finite = bool(np.all(np.isfinite(result.losses)) and np.all(np.isfinite(
            result.grad_norms)))
        row = {"model": label, "run": run, "steps": steps, "final_loss": final,
               "finite": finite, "loss_diff": 0.0, "grad_error": {}}
        if reference is None:
            reference = result
        else:
            row["loss_diff"] = final / float(np.mean(reference.losses[-tail:])) - 1
            row["grad_error"] = leaf_errors(result.grads, reference.grads)
        passes = finite and abs(row["loss_diff"]) <= LOSS_RTOL and all(
            e < GRAD_RTOL for e in row["grad_error"].values())
        row["checks"] = "-" if run == "bf16" else "pass" if passes else "FAIL"
        rows.append(row)
        print(f"  {label} {run}: final loss {final:.4f}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--steps-1b", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    tokens = data.load_corpus(None, args.seq_len).train
    one_b = get_preset("llama3.2-1b", n_layers=4, vocab_size=get_preset("small").vocab_size)
    rows = run_model("small", get_preset("small"), args.steps, args.batch_size, args.seq_len,
                     tokens)
    if args.steps_1b:
        rows += run_model("1b x4", one_b, args.steps_1b, 4, 64, tokens)
    ok = all((r["checks"] == "FAIL") == (r["run"] == "sabotaged") for r in rows
             if r["run"] != "bf16")
    common.emit({"rows": rows, "ok": ok}, args.json, lambda: [
        "FP8 against bf16 (one CPU device): final loss, and each projection's first-step "
        f"gradient error; checks: loss within {LOSS_RTOL:.0%}, finite, gradients within "
        f"{GRAD_RTOL:.0%}; the sabotaged run (inverted scales) must fail",
        *common.table(rows, COLUMNS), "", "ok" if ok else "NOT OK"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
