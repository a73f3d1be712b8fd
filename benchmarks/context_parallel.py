"""Context parallelism: what each attention strategy costs one device, read off the compiler.

    python benchmarks/context_parallel.py [--seq-lens 1024,2048,4096,8192,16384] [--json]

For the attention core of one layer (forward + backward; batch 1, 8 heads, 4 kv heads,
head dim 64, float32, causal) on 8 simulated devices:
  1. per-device compiled temp bytes (`memory_analysis`) of no CP (one device holds the
     whole sequence), all_gather, ulysses and ring, and the collective bytes each moves per
     layer (HLO, loop bodies counted per iteration), for each sequence length;
  2. ring vs all_gather temp bytes as the ring grows (N = 2, 4, 8) at the longest length;
  3. per-device causal work of the ring (score tiles it computes, by the kernel's own
     schedule) with contiguous sharding and with chunk-pair load balancing.
Targets: ring memory ~1/N at fixed S; balanced max/min work <= 1.1.
"""

from __future__ import annotations

import common
from common import Column, MiB

common.setup_devices(8)

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jdist.models.layers import dot_product_attention
from jdist.parallel.attention.context import ALL_GATHER, RING, ULYSSES, ContextParallel
from jdist.parallel.attention.load_balance import ring_work
from jdist.spmd.mesh import build_mesh
from jdist.spmd.rules import DEFAULT_RULES
from jdist.tools.hlo import executed_collective_bytes

NO_CP = "no_cp"


def attention_fn(strategy: str, n: int):
    """(q, k, v, dout) -> (dq, dk, dv), jitted, and the shardings of q and k/v."""
    if strategy == NO_CP:
        mesh = build_mesh("dp=1", jax.devices()[:1])
        attend = dot_product_attention
        q_sh = kv_sh = NamedSharding(mesh, jax.sharding.PartitionSpec())
    else:
        mesh = build_mesh(f"sp={n}", jax.devices()[:n])
        cp = ContextParallel(mesh, DEFAULT_RULES, strategy)
        attend = cp.attention
        q_sh, kv_sh = NamedSharding(mesh, cp.q_spec), NamedSharding(mesh, cp.kv_spec)

    def fwd_bwd(q, k, v, dout):
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(dout)
    return jax.jit(fwd_bwd), q_sh, kv_sh


def measure(strategy: str, n: int, seq_len: int, heads: int, kv_heads: int, head_dim: int):
    """Per-device temp bytes and per-layer collective bytes of one compiled fwd+bwd."""
    fn, q_sh, kv_sh = attention_fn(strategy, n)
    q = jax.ShapeDtypeStruct((1, seq_len, heads, head_dim), jnp.float32, sharding=q_sh)
    kv = jax.ShapeDtypeStruct((1, seq_len, kv_heads, head_dim), jnp.float32, sharding=kv_sh)
    compiled = fn.lower(q, kv, kv, q).compile()
    comm = executed_collective_bytes(compiled.as_text())
    return {"temp_bytes": common.temp_bytes(compiled),
            "collective_bytes": {op: b for op, b in comm.items() if b}}


def imbalance(work: list[int]) -> float:
    return max(work) / min(work)


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    shape = (args.heads, args.kv_heads, args.head_dim)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    strategies = (NO_CP, ALL_GATHER, ULYSSES, RING)
    by_length = [{"seq_len": s, **{st: measure(st, 8, s, *shape) for st in strategies}}
                 for s in seq_lens]
    longest = seq_lens[-1]
    by_devices = [{"devices": n, **{st: measure(st, n, longest, *shape)
                                    for st in (ALL_GATHER, RING)}} for n in (2, 4, 8)]
    work = [{"devices": n, "contiguous": ring_work(n, balanced=False),
             "balanced": ring_work(n, balanced=True)} for n in (2, 4, 8)]
    for row in work:
        row["imbalance"] = {k: imbalance(row[k]) for k in ("contiguous", "balanced")}
    result = {"shape": {"batch": 1, "heads": args.heads, "kv_heads": args.kv_heads,
                        "head_dim": args.head_dim, "dtype": "float32", "causal": True},
              "by_seq_len_8_devices": by_length, "by_devices": by_devices,
              "ring_work_tiles": work, "targets": {"balanced_imbalance_max": 1.1}}
    common.emit(result, args.json, lambda: tables(by_length, by_devices, work, strategies,
                                                  longest))


def tables(by_length, by_devices, work, strategies, longest) -> list[str]:
    temps = [Column(s, "10.1f", lambda r, s=s: r[s]["temp_bytes"], MiB) for s in strategies]
    comms = [Column(s, "10.1f", lambda r, s=s: sum(r[s]["collective_bytes"].values()), MiB)
             for s in strategies[1:]]
    ring = [Column("N", ">3", "devices"),
            Column("all_gather", "11.1f", lambda r: r[ALL_GATHER]["temp_bytes"], MiB),
            Column("ring", "9.1f", lambda r: r[RING]["temp_bytes"], MiB),
            Column("ring x N", "9.1f", lambda r: r[RING]["temp_bytes"] * r["devices"], MiB)]
    return ["attention fwd+bwd per device, 8 devices: compiled temp MiB | collective MiB/layer",
            *common.table(by_length, [Column("seq", ">6", "seq_len"), *temps,
                                      Column("|", "", lambda r: "|"), *comms]),
            f"\nscaling with devices at seq {longest}: temp MiB per device",
            *common.table(by_devices, ring),
            "\nring causal work per device (score tiles), max/min",
            *(f"N={row['devices']}: contiguous {row['contiguous']} -> "
              f"{row['imbalance']['contiguous']:.2f}; balanced {row['balanced']} -> "
              f"{row['imbalance']['balanced']:.2f}" for row in work)]


if __name__ == "__main__":
    main()
