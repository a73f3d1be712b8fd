"""Multi-head latent attention's costs (`jdist.models.mla`), DeepSeek-V3's shape (128 heads,
q/k head 128 no-rope + 64 rope dims, v_head_dim 128, kv_lora_rank 512), bfloat16.

Attention: one layer's attention core, forward and backward, one sequence, counted from
the program XLA's GPU compiler builds for `--target` (default h100-80gb; compile-only
devices, nothing runs; `jdist.tools.gpu_report`: every dot times the trip counts of the
loops around it). jdist pads values from 128 to the q/k width 192 so that every kernel
(flash, cuDNN, the context-parallel ones) takes one head width; `padded` rows are what runs,
`v 128` is the dense attention on unpadded values, the cost the padding adds to.

Cache: bytes per token of the decoding cache, from the shapes `jdist.generate.cache`
allocates: MLA's latent and rope key per layer, against per-head keys and values of the
same heads (the model without MLA).

    python benchmarks/mla.py [--json] [--target h100-80gb] [--seq-len 4096]
"""

from __future__ import annotations

import dataclasses

import common
from common import Column

common.setup_devices(1, cpu_only=True)

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jdist.generate.cache import cache_bytes
from jdist.models import get_preset
from jdist.models.layers import dot_product_attention
from jdist.parallel.attention.blockwise import Q_TILE
from jdist.parallel.attention.flash import flash_attention
from jdist.runtime import target as gpu_target
from jdist.spmd.mesh import build_mesh
from jdist.tools import gpu_report

CFG = get_preset("deepseek-v3")
HEADS, QK, V = CFG.n_heads, CFG.dim_per_head, CFG.value_dim


def unpadded(q, k, v):
    """Dense causal attention with values narrower than q/k (no kernel of jdist's)."""
    scores = jnp.einsum("bshd,bthd->bhst", q, k, preferred_element_type=jnp.float32)
    s = q.shape[1]
    mask = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores * QK ** -0.5, -1e30), -1).astype(v.dtype)
    return jnp.einsum("bhst,bthd->bshd", probs, v)


def executed_flops(kernel: str, seq: int, target: str) -> float:
    device = gpu_target.devices(target, 1)[0]
    shape = lambda d: jax.ShapeDtypeStruct((1, seq, HEADS, d), jnp.bfloat16,
                                           sharding=SingleDeviceSharding(device))
    attend, v_dim = {"flash, padded": (lambda q, k, v: flash_attention(q, k, v, True), QK),
                     "xla, padded": (lambda q, k, v: dot_product_attention(q, k, v, True), QK),
                     "xla, v 128": (unpadded, V)}[kernel]
    grad = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
    compiled = jax.jit(grad).lower(shape(QK), shape(QK), shape(v_dim)).compile(
        dict(gpu_target.COMPILER_OPTIONS))
    causal_trips = (seq // Q_TILE + 1) / 2  # flash's causal loops, at their mean
    return gpu_report.report(compiled.as_text(), build_mesh("dp=1", [device]),
                             unknown_trips=causal_trips).executed_flops


def attention_rows(seq: int, target: str) -> list[dict]:
    out = [{"kernel": k, "seq_len": seq, "executed_tflop": executed_flops(k, seq, target) / 1e12}
           for k in ("flash, padded", "xla, padded", "xla, v 128")]
    ideal = out[-1]["executed_tflop"]
    return [r | {"x_unpadded": r["executed_tflop"] / ideal} for r in out]


def cache_rows() -> list[dict]:
    per_token = lambda cfg: cache_bytes(cfg, 1, 1, jnp.bfloat16) - 8  # less length and start
    heads = dataclasses.replace(CFG, kv_lora_rank=0, q_lora_rank=0)
    return [{"cache": name, "bytes_per_token": per_token(cfg), "layers": cfg.n_layers}
            for name, cfg in (("MLA latent + rope key", CFG), ("per-head k and v", heads))]


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    gpu_target.check_plugin()
    result = {"target": args.target, "compiler": f"XLA's GPU compiler for {args.target}",
              "attention": attention_rows(args.seq_len, args.target), "cache": cache_rows()}
    attention = [Column("attention", "14", "kernel"), Column("tokens", ">7", "seq_len"),
                 Column("TFLOP", ">8.3f", "executed_tflop"),
                 Column("x v 128", ">8.3f", "x_unpadded")]
    cache = [Column("decoding cache", "22", "cache"), Column("layers", ">6"),
             Column("KiB/token", ">10.1f", lambda r: r["bytes_per_token"] / 1024)]
    common.emit(result, args.json, lambda: [
        *common.table(result["attention"], attention),
        result["compiler"] + ", one layer, forward + backward", "",
        *common.table(result["cache"], cache), "bfloat16, from the cache's shapes"])


if __name__ == "__main__":
    main()
