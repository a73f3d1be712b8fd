"""Dequantization error of NF4 (jdist.quant.nf4), plain and with double quantization, beside a plain
absmax int4 baseline with the same blocks of 64, on Llama-like weight tensors.

    python benchmarks/nf4.py [--json] [--small]

Weights: N(0, 0.02) of [4096, 4096] and [4096, 14336], and a heavy-tailed Student-t (3
degrees of freedom, scaled to std 0.02) of [4096, 4096]; --small shrinks them to 256 rows so
the run takes seconds. int4 is symmetric absmax: round(x / absmax * 7) / 7 * absmax (codes
-7..7; the 16th, -8, unused), 16 levels spaced evenly where NF4 spaces them like a normal
distribution's quantiles - which is why NF4's error is lower on normal (and t) weights. (Its
max error is higher on normal weights: NF4's widest gap, 0.72 to 1, is wider than 1/7.)
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(1, cpu_only=True)

import jax
import jax.numpy as jnp

from jdist.quant import nf4

STD = 0.02
COLUMNS = (Column("tensor", "12"), Column("shape", ">12", lambda r: "x".join(map(str, r["shape"]))),
           Column("method", "7"), Column("rms err", "10.3e", "rms_error"),
           Column("max abs", "10.3e", "max_abs_error"),
           Column("rel frob", "9.4f", "rel_frobenius"), Column("rel |err|", "9.4f", "rel_mean_abs"),
           Column("B/param", "8.4f", "bytes_per_param"))


def weights(kind: str, shape: tuple[int, int], seed: int) -> jax.Array:
    z = jax.random.normal(jax.random.key(seed), (1 if kind == "normal" else 4, *shape))
    if kind == "normal":
        return STD * z[0]
    # Student-t, 3 degrees of freedom: z / sqrt(chi2_3 / 3), variance 3 (jax.random.t's
    # gamma sampler takes minutes on CPU for 16M values; three squared normals take none)
    return STD / jnp.sqrt(3.0) * z[0] / jnp.sqrt(jnp.sum(z[1:] ** 2, axis=0) / 3)


def int4_roundtrip(w: jax.Array) -> jax.Array:
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // nf4.BLOCK, nf4.BLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    safe = jnp.where(absmax > 0, absmax, 1)
    return (jnp.round(blocks / safe * 7) / 7 * absmax).reshape(w.shape)


@jax.jit
def stats(w: jax.Array, approx: jax.Array) -> dict:
    err = (approx - w).astype(jnp.float32)
    return {"rms_error": jnp.sqrt(jnp.mean(err**2)), "max_abs_error": jnp.max(jnp.abs(err)),
            "rel_frobenius": jnp.linalg.norm(err) / jnp.linalg.norm(w),
            "rel_mean_abs": jnp.mean(jnp.abs(err)) / jnp.mean(jnp.abs(w))}


def rows_for(name: str, w: jax.Array) -> list[dict]:
    methods = {
        "nf4": (jax.jit(lambda w: nf4.dequantize(nf4.quantize(w))),
                nf4.bytes_per_param(w.shape, False)),
        "nf4+dq": (jax.jit(lambda w: nf4.dequantize(nf4.quantize(w, double_quant=True))),
                   nf4.bytes_per_param(w.shape, True)),
        "int4": (jax.jit(int4_roundtrip), 0.5 + 4 / nf4.BLOCK),
    }
    rows = []
    for method, (roundtrip, bpp) in methods.items():
        s = {k: float(v) for k, v in stats(w, roundtrip(w)).items()}
        rows.append({"tensor": name, "shape": list(w.shape), "method": method, **s,
                     "bytes_per_param": bpp})
    return rows


def checks(rows: list[dict]) -> list[str]:
    out = []
    for tensor in dict.fromkeys(r["tensor"] for r in rows):
        by = {r["method"]: r for r in rows if r["tensor"] == tensor}
        ratio = by["nf4"]["rms_error"] / by["int4"]["rms_error"]
        cost = by["nf4+dq"]["rms_error"] / by["nf4"]["rms_error"] - 1
        saved = by["nf4"]["bytes_per_param"] - by["nf4+dq"]["bytes_per_param"]
        out.append(f"{tensor}: NF4 RMS error = {ratio:.2f} x int4's "
                   f"({'ok' if ratio < 1 else 'NOT LOWER'}); double quantization: "
                   f"{cost:+.2%} RMS error, {saved:.4f} fewer bytes per parameter")
    return out


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--small", action="store_true", help="256-row tensors (seconds)")
    args = parser.parse_args()
    rows_n = 256 if args.small else 4096
    tensors = [("normal", "normal", (rows_n, 4096)), ("normal-mlp", "normal", (rows_n, 14336)),
               ("student-t3", "t", (rows_n, 4096))]
    rows = []
    for seed, (name, kind, shape) in enumerate(tensors):
        rows += rows_for(name, weights(kind, shape, seed))
    result = {"rows": rows, "checks": checks(rows)}
    common.emit(result, args.json, lambda: common.table(rows, COLUMNS) + result["checks"],
                indent=2)


if __name__ == "__main__":
    main()
