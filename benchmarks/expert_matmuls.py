"""What a mixture-of-experts layer's expert matmuls execute on a GPU, from the GPU compiler
(deviceless, `--target`): for one expert projection of a layer's routed tokens, the
executed matmul FLOPs (`jdist.gpu_report`) against the routed FLOPs, and the compiled
temporaries, for

  padded   jdist's dropless path today (`models.moe`): every expert gets a buffer with room
           for every token, [E, T, d] x [E, d, f]
  ragged   `jax.lax.ragged_dot` over the tokens sorted by expert, [T x k, d] x [E, d, f]
           with group sizes: the grouped matmul a dropless MoE wants

    python benchmarks/expert_matmuls.py [--json] [--target h100-80gb]

Shapes (one device's tokens of one layer, bf16): Qwen3-30B-A3B (8192 tokens, top-8 of 128
experts, d 2048, f 768) and Mixtral 8x7B (8192 tokens, top-2 of 8, d 4096, f 14336).
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(1, cpu_only=True)

SHAPES = {  # tokens, experts, top-k, d, f
    "qwen3-30b-a3b": (8192, 128, 8, 2048, 768),
    "mixtral-8x7b": (8192, 8, 2, 4096, 14336),
}
COLUMNS = (Column("shape", "14"), Column("path", "7"),
           Column("routed TFLOP", "13.3f", "routed_tflop"),
           Column("executed TFLOP", "15.3f", "executed_tflop"),
           Column("x routed", "9.1f", "ratio"), Column("temp GiB", "9.2f", "temp_gib"))


def measure(name: str, target: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, SingleDeviceSharding

    from jdist import gpu_report
    from jdist.target import COMPILER_OPTIONS, devices

    tokens, experts, k, d, f = SHAPES[name]
    device = devices(target, 1)[0]
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
        shape, dtype, sharding=SingleDeviceSharding(device))
    programs = {
        "padded": (lambda h, w: jnp.einsum("etd,edf->etf", h, w),
                   (spec(experts, tokens, d), spec(experts, d, f))),
        "ragged": (lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes),
                   (spec(tokens * k, d), spec(experts, d, f), spec(experts, dtype=jnp.int32))),
    }
    routed = 2.0 * tokens * k * d * f
    rows = []
    for path, (fn, args) in programs.items():
        compiled = jax.jit(fn).lower(*args).compile(dict(COMPILER_OPTIONS))
        rep = gpu_report.report(compiled.as_text(), Mesh(np.array([device]), ("data",)))
        rows.append({"shape": name, "path": path, "routed_tflop": routed / 1e12,
                     "executed_tflop": rep.executed_flops / 1e12,
                     "ratio": rep.executed_flops / routed,
                     "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30})
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    args = parser.parse_args()
    from jdist.target import prepare_target

    prepare_target(args.target)
    rows = [r for name in SHAPES for r in measure(name, args.target)]
    common.emit(rows, args.json, lambda: common.table(rows, COLUMNS))


if __name__ == "__main__":
    main()
