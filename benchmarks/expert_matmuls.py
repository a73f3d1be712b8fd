"""What a mixture-of-experts layer's experts execute on a GPU, from the GPU compiler
(deviceless, `--target`): one device's routed tokens of one layer through the experts' three
projections, forward and backward, for

  padded   `--moe-routing dropless`: every expert gets a buffer with room for every token,
           [E, T, d] (`models.moe`)
  ragged   `jax.lax.ragged_dot` over the assignments sorted by expert, [T k, d] x [E, d, f]
           with group sizes
  grouped  `--moe-routing grouped`: the assignments sorted into one-expert blocks, a
           blocked grouped matmul (`models.grouped`)

Columns: routed and executed matmul TFLOP of the experts (forward + backward, loops counted
by their trip counts; the router's matmul left out); the dispatch buffer (tokens in expert
order: [E, T, d] padded, [T k, d] ragged, the blocked rows grouped; its shape is looked up in
the compiled HLO) over the routed activations [T k, d]; the compiled forward's temporaries.

    python benchmarks/expert_matmuls.py [--json] [--target h100-80gb]

Shapes (bf16): Qwen3-30B-A3B (8192 tokens, top-8 of 128 experts, d 2048, f 768) and
Mixtral 8x7B (8192 tokens, top-2 of 8, d 4096, f 14336).

Then the whole MoE layer on 8 GPUs with ep=8 (`jdist.parallel.moe`, 8192 tokens per
device), dropless against grouped (whose tokens travel in bounded rounds,
`jdist.parallel.expert_rounds`; the numbers are the first round's, which is all of it when
routing is near balance: the loop of later rounds is counted 0 times): the forward's all-to-all
bytes per device over the routed tokens' bytes there and back, and the executed expert
FLOPs of forward + backward over the routed ones.
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(8, cpu_only=True)

SHAPES = {  # tokens, experts, top-k, d, f
    "qwen3-30b-a3b": (8192, 128, 8, 2048, 768),
    "mixtral-8x7b": (8192, 8, 2, 4096, 14336),
}
COLUMNS = (Column("shape", "14"), Column("path", "7"),
           Column("routed TFLOP", "13.2f", "routed_tflop"),
           Column("executed TFLOP", "15.2f", "executed_tflop"),
           Column("x routed", "9.2f", "flops_ratio"),
           Column("dispatch x routed", "18.3f", "dispatch_ratio"),
           Column("fwd temp GiB", "13.2f", "forward_temp_gib"))


def programs(tokens: int, experts: int, k: int, d: int, f: int):
    """path -> (expert outputs [T, k, d] of tokens x [T, d] routed to ids [T, k] with
    weights gate, up, down; the dispatch buffer's shape)."""
    import jax
    import jax.numpy as jnp

    from jdist.models import grouped, moe

    def padded(x, ids, gate, up, down):
        slots = moe.positions_in_experts(ids, experts)
        buf = moe.dispatch(x, ids, slots, tokens, experts)
        return moe.swiglu(buf, gate, up, down).at[ids, slots].get(mode="fill", fill_value=0)

    def ragged(x, ids, gate, up, down):
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros(experts, jnp.int32).at[flat].add(1)
        rows = x[order // k]
        h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * \
            jax.lax.ragged_dot(rows, up, sizes)
        out = jax.lax.ragged_dot(h, down, sizes)
        return jnp.zeros_like(out).at[order].set(out).reshape(tokens, k, d)

    shape = grouped.blocks_for(tokens * k, experts, d * f * 2)
    return {"padded": (padded, (experts, tokens, d)), "ragged": (ragged, (tokens * k, d)),
            "grouped": (lambda x, ids, *w: grouped.grouped_swiglu(x, ids, *w),
                        (shape.n_blocks // shape.chunk, shape.chunk, shape.block, d))}


def measure(name: str, target: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, SingleDeviceSharding

    from jdist.models import grouped
    from jdist.runtime.target import COMPILER_OPTIONS, devices
    from jdist.tools import gpu_report

    tokens, experts, k, d, f = SHAPES[name]
    device = devices(target, 1)[0]
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
        shape, dtype, sharding=SingleDeviceSharding(device))
    args = (spec(tokens, d), spec(tokens, k, dtype=jnp.int32), spec(experts, d, f),
            spec(experts, d, f), spec(experts, f, d))
    routed = 3 * 2.0 * tokens * k * d * f * 3  # 3 projections; forward, input, weight grads
    routed_bytes = tokens * k * d * 2
    paths = programs(tokens, experts, k, d, f)
    rows = []
    for path, (fn, dispatch_shape) in paths.items():
        def loss(x, ids, *w, fn=fn):
            return jnp.sum(fn(x, ids, *w).astype(jnp.float32) ** 2)

        both = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))
        compiled = both.lower(*args).compile(dict(COMPILER_OPTIONS))
        rep = gpu_report.report(compiled.as_text(), Mesh(np.array([device]), ("data",)))
        forward = jax.jit(fn).lower(*args).compile(dict(COMPILER_OPTIONS))
        text = f"bf16[{','.join(map(str, dispatch_shape))}]"
        in_hlo = text in forward.as_text()
        rows.append({"shape": name, "path": path, "routed_tflop": routed / 1e12,
                     "executed_tflop": rep.executed_flops / 1e12,
                     "flops_ratio": rep.executed_flops / routed,
                     "dispatch_shape": text, "dispatch_in_hlo": in_hlo,
                     "dispatch_ratio": np.prod(dispatch_shape) * 2 / routed_bytes
                     if in_hlo else float("nan"),
                     "forward_temp_gib": forward.memory_analysis().temp_size_in_bytes / 2**30,
                     "block_rows": grouped.block_rows(tokens * k, experts)})
    return rows


EP_COLUMNS = (Column("shape", "14"), Column("routing", "9"),
              Column("a2a MiB fwd", "12.1f", "a2a_mib"),
              Column("x routed bytes", "15.2f", "a2a_ratio"),
              Column("executed TFLOP", "15.2f", "executed_tflop"),
              Column("x routed", "9.2f", "flops_ratio"))


def ep_layer(name: str, target: str, n_ep: int, tokens: int = 0):
    """(mesh, x, w): the abstract inputs of one MoE layer of shape `name` on `n_ep` GPUs
    with ep=n_ep, `tokens` per device (0: the shape's), bf16 (the router's weight float32)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jdist.parallel.moe import WEIGHT_NAMES, X_NAMES
    from jdist.runtime.target import devices
    from jdist.spmd.mesh import build_mesh
    from jdist.spmd.rules import DEFAULT_RULES, resolve

    _, experts, _, d, f = SHAPES[name]
    mesh = build_mesh(f"ep={n_ep}", devices(target, n_ep))
    sharded = lambda names, shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, resolve(names, DEFAULT_RULES, mesh)))
    x = sharded(X_NAMES, (n_ep, tokens or SHAPES[name][0], d))
    w = {"router": sharded(WEIGHT_NAMES["router"], (d, experts), jnp.float32),
         **{key: sharded(WEIGHT_NAMES[key], (experts, *dims)) for key, dims in
            (("w_gate", (d, f)), ("w_up", (d, f)), ("w_down", (f, d)))}}
    return mesh, x, w


def measure_ep(name: str, target: str, n_ep: int = 8) -> list[dict]:
    """One MoE layer (router included, its FLOPs taken off) on `n_ep` GPUs with ep=n_ep."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jdist.models import get_preset
    from jdist.parallel.moe import moe_ffn
    from jdist.runtime.target import COMPILER_OPTIONS
    from jdist.spmd.rules import DEFAULT_RULES
    from jdist.tools import gpu_report

    tokens, experts, k, d, f = SHAPES[name]
    mesh, x, w = ep_layer(name, target, n_ep)
    routed_bytes = tokens * k * d * 2 * 2  # there and back
    routed = 3 * 2.0 * tokens * k * d * f * 3
    router = 2.0 * tokens * d * experts * 3
    rows = []
    for routing in ("dropless", "grouped"):
        cfg = dataclasses.replace(get_preset(name), moe_routing=routing, d_ff=f)
        layer = lambda x, w, cfg=cfg: moe_ffn(x, w, cfg, mesh=mesh, rules=DEFAULT_RULES)[0]
        forward = jax.jit(layer).lower(x, w).compile(dict(COMPILER_OPTIONS))
        # Near balance every token is served in the first round: no later round runs.
        a2a = sum(r.bytes for r in gpu_report.report(forward.as_text(), mesh,
                                                     unknown_trips=0).rows
                  if r.kind == "all-to-all")
        loss = lambda x, w, layer=layer: jnp.sum(layer(x, w).astype(jnp.float32) ** 2)
        both = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile(
            dict(COMPILER_OPTIONS))
        executed = gpu_report.report(both.as_text(), mesh,
                                     unknown_trips=0).executed_flops - router
        rows.append({"shape": name, "routing": routing, "a2a_mib": a2a / 2**20,
                     "a2a_ratio": a2a / routed_bytes, "executed_tflop": executed / 1e12,
                     "flops_ratio": executed / routed})
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    args = parser.parse_args()
    from jdist.runtime.target import prepare_target

    prepare_target(args.target)
    rows = [r for name in SHAPES for r in measure(name, args.target)]
    ep = [r for name in SHAPES for r in measure_ep(name, args.target)]
    common.emit({"one_device": rows, "ep8": ep}, args.json, lambda: [
        *common.table(rows, COLUMNS), "\nthe layer on 8 GPUs, ep=8:",
        *common.table(ep, EP_COLUMNS)])


if __name__ == "__main__":
    main()
