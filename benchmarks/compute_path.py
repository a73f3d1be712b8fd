"""Memory of the real-scale compute path, from compiled programs (deterministic; AOT on CPU):
attention and loss alone, and the whole Llama-3-8B step, flash/chunked beside xla/full.

    python benchmarks/compute_path.py [--json] [--skip-steps]

Targets (issue 12):
  - `llama3-8b`, fsdp=8, ZeRO-3, 8 x 8192 tokens, full remat, bf16, flash attention and the
    chunked loss: compiled step peak <= 24 GiB per device;
  - with flash, the step's temporaries at 16384 tokens <= 2.3 x those at 8192 (linear);
  - the loss's temporaries (forward + backward) <= 10% of the float32 logits' bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")  # AOT on CPU devices, on any host
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jdist.loss import cross_entropy  # noqa: E402
from jdist.memory import compile_step, peak  # noqa: E402
from jdist.mesh import build_mesh  # noqa: E402
from jdist.parallel.flash import flash_attention  # noqa: E402
from jdist.parallel.vocab import vocab_parallel_cross_entropy  # noqa: E402
from jdist.train.config import TrainConfig  # noqa: E402
from jdist.train.setup import plan_for  # noqa: E402
from models import get_preset  # noqa: E402
from models.layers import dot_product_attention  # noqa: E402

MODEL = "llama3-8b"
BF16 = jnp.bfloat16


def temp_bytes(fn, *shapes) -> int:
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def attention_rows() -> list[dict]:
    """One layer's attention, forward and backward, one 8B sequence on one device."""
    cfg = get_preset(MODEL)
    rows = []
    for seq in (8192, 16384):
        q = jax.ShapeDtypeStruct((1, seq, cfg.n_heads, cfg.dim_per_head), BF16)
        kv = jax.ShapeDtypeStruct((1, seq, cfg.n_kv_heads, cfg.dim_per_head), BF16)
        for name, attend in (("xla", dot_product_attention), ("flash", flash_attention)):
            grad = jax.grad(lambda q, k, v, f=attend: f(q, k, v, True).astype(jnp.float32).sum(),
                            (0, 1, 2))
            rows.append({"what": "attention", "impl": name, "seq_len": seq,
                         "temp_bytes": temp_bytes(grad, q, kv, kv)})
    return rows


def loss_rows() -> list[dict]:
    """The loss of one 8B sequence (8192 tokens, vocab 128256) with its gradients, from the
    float32 master weight and bf16 hidden states, as the step runs it (the full loss casts
    the weight to bf16 for its matmul; the chunked one casts a chunk at a time)."""
    cfg = get_preset(MODEL)
    mesh = build_mesh("dp=1", jax.devices()[:1])
    tokens = 8192
    h = jax.ShapeDtypeStruct((1, tokens, cfg.d_model), BF16)
    w = jax.ShapeDtypeStruct((cfg.d_model, cfg.vocab_size), jnp.float32)
    labels = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def full(h, w, labels):
        return cross_entropy(jnp.einsum("bse,ev->bsv", h, w.astype(BF16)), labels).sum()

    def chunked(h, w, labels):
        return vocab_parallel_cross_entropy(h, w, labels, vocab_dim=1, mesh=mesh, h_spec=P(),
                                            w_spec=P(), label_spec=P()).sum()

    logits = tokens * cfg.vocab_size * 4
    return [{"what": "loss", "impl": name, "seq_len": tokens,
             "temp_bytes": temp_bytes(jax.grad(fn, (0, 1)), h, w, labels),
             "f32_logits_bytes": logits} for name, fn in (("full", full), ("chunked", chunked))]


def step_rows() -> list[dict]:
    rows = []
    for seq, attention, loss in ((8192, "flash", "chunked"), (16384, "flash", "chunked"),
                                 (8192, "xla", "full")):
        config = TrainConfig(model=MODEL, mesh="fsdp=8", zero=3, batch_size=8, seq_len=seq,
                             remat="full", compute_dtype="bfloat16", attention=attention,
                             loss=loss)
        _, plan, _ = plan_for(config)
        compiled = compile_step(plan, config.batch_size, seq)
        m = compiled.memory_analysis()
        rows.append({"what": "step", "impl": f"{attention}+{loss}", "seq_len": seq,
                     "peak_bytes": peak(compiled), "temp_bytes": m.temp_size_in_bytes})
    return rows


def checks(rows: list[dict]) -> list[str]:
    out = []
    by = {(r["what"], r["impl"], r["seq_len"]): r for r in rows}
    chunked = by[("loss", "chunked", 8192)]
    share = chunked["temp_bytes"] / chunked["f32_logits_bytes"]
    out.append(f"loss temporaries {share:.1%} of the f32 logits (target <= 10%): "
               f"{'ok' if share <= 0.10 else 'MISSED'}")
    if ("step", "flash+chunked", 8192) in by:
        s8, s16 = by[("step", "flash+chunked", 8192)], by[("step", "flash+chunked", 16384)]
        gib = s8["peak_bytes"] / 2**30
        out.append(f"8B 8x8192 step peak {gib:.2f} GiB (target <= 24): "
                   f"{'ok' if gib <= 24 else 'MISSED'}")
        ratio = s16["temp_bytes"] / s8["temp_bytes"]
        out.append(f"step temporaries 16384 / 8192 tokens = {ratio:.2f} (target <= 2.3): "
                   f"{'ok' if ratio <= 2.3 else 'MISSED'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-steps", action="store_true",
                        help="only attention and loss (the whole-step compiles take minutes)")
    args = parser.parse_args()
    rows = attention_rows() + loss_rows() + ([] if args.skip_steps else step_rows())
    result = {"rows": rows, "checks": checks(rows)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'what':10} {'impl':14} {'tokens':>7} {'temporaries':>12} {'peak':>10}")
    for r in rows:
        peak_text = f"{r['peak_bytes'] / 2**30:9.2f}G" if "peak_bytes" in r else ""
        print(f"{r['what']:10} {r['impl']:14} {r['seq_len']:>7} "
              f"{r['temp_bytes'] / 2**30:11.3f}G {peak_text:>10}")
    print("\n".join(result["checks"]))


if __name__ == "__main__":
    main()
