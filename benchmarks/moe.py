"""Mixture of experts on 8 simulated devices (`moe-small`).

1. All-to-all bytes of one MoE layer's forward pass per device, read off the compiled
   HLO, against the analytical volume tokens x k x d_model x bytes x 2 directions x (N-1)/N.
   Buffers are padded to capacity (capacity routing: factor x the even share; dropless:
   room for every token), so the ratio should equal the capacity factor, or E/k.
2. Step time of expert parallelism (ep=8) against experts replicated on every device
   (dp=8), timed in one run.
3. The fraction of dropped assignments as the capacity factor varies.
4. At today's scale, from the GPU compiler (`--target`, deviceless): one device's layer of
   Qwen3-30B-A3B (8192 tokens, top-8 of 128) and Mixtral 8x7B through the experts, padded
   dropless against grouped (and `lax.ragged_dot`): executed over routed FLOPs, the dispatch
   buffer over the routed activations (benchmarks/expert_matmuls.py; `--target none` skips).
5. Balancing over training (`--balance-steps`, 0 skips): the load imbalance (most-loaded
   expert over the mean, in the worst layer) and cross-entropy of moe-small trained on one
   device (ep=8 computes the same: tests/test_moe.py) without balancing, with the Switch
   aux loss, and with DeepSeek-V3's routing biases (aux-loss-free) at two rates; the mean
   over the last 10 steps, batches of 16 x 64.
6. Qwen3-30B-A3B with 2 layers on the GPU compiler (`--scale-layouts`, none skips; slow: a
   few minutes per compile on 2 cores): the exposed share of the all-to-all bytes on ep=8,
   the planner's best 16-GPU layout and fsdp=2,ep=8, grouped and padded, before and after
   `--moe-overlap`, and the memory model against the compiled peak under none, selective
   and full remat (benchmarks/moe_at_scale.py).

    python benchmarks/moe.py [--batch-size 32] [--seq-len 128] [--target h100-80gb]
                             [--balance-steps 100] [--scale-layouts ep8,best16,fsdp-ep] [--json]
"""

from __future__ import annotations

import dataclasses

import common
import expert_matmuls
import moe_at_scale
from common import Column, MiB

common.setup_devices(8, cpu_only=True)  # the GPU target compiles without a GPU backend

import jax
import jax.numpy as jnp
import numpy as np

from jdist import data
from jdist.models import get_preset
from jdist.spmd.mesh import build_mesh
from jdist.step import init_state, make_train_step
from jdist.step.build import gradients, make_eval_step
from jdist.tools.hlo import collective_bytes, loop_bodies

N = 8
VOLUME = (Column("routing", "10"), Column("factor", "6.2f", "capacity_factor"),
          Column("a2a MiB/layer fwd", "18.3f", "measured_bytes", MiB),
          Column("analytical", "11.3f", "analytical_bytes", MiB), Column("ratio", "6.2f"))
BALANCE = (Column("balancing", "22"), Column("load imbalance", "14.3f", "imbalance"),
           Column("ce loss", "8.4f", "ce_loss"))
BALANCINGS = {"none": {"aux_loss_weight": 0.0},
              "aux loss 0.01": {"aux_loss_weight": 0.01},
              "router bias 0.001": {"aux_loss_weight": 0.0, "router_bias_rate": 0.001},
              "router bias 0.01": {"aux_loss_weight": 0.0, "router_bias_rate": 0.01}}
DROPS = (Column("capacity factor", "15.2f", "capacity_factor"),
         Column("dropped", "8.3f", "dropped_fraction"))


def plan_for(model, mesh: str):
    return common.simple_plan(model, build_mesh(mesh))


def all_to_all_volume(model, batch_size: int, seq_len: int) -> dict:
    plan = plan_for(model, f"ep={N}")
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    forward = make_eval_step(plan)
    text = forward.lower(plan.abstract.params, {"inputs": tokens, "targets": tokens}) \
        .compile().as_text()
    per_layer = sum(collective_bytes(b)["all-to-all"] for b in loop_bodies(text))
    measured = per_layer * (N - 1) / N  # the device's own slice does not travel
    local_tokens = batch_size * seq_len // N
    analytical = local_tokens * model.top_k * model.d_model * 4 * 2 * (N - 1) / N
    return {"routing": model.moe_routing, "capacity_factor": model.capacity_factor,
            "measured_bytes": measured, "analytical_bytes": analytical,
            "ratio": measured / analytical}


def steps_per_sec(model, mesh: str, batch, steps: int = 4) -> float:
    plan = plan_for(model, mesh)
    state = init_state(plan, 0)
    step = make_train_step(plan)
    b = {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}
    return steps / common.time_steps(step, state, [b], steps)[2]  # warm-up compiles


def dropped_fraction(model, batch) -> float:
    plan = plan_for(model, f"ep={N}")
    state = init_state(plan, 0)
    b = {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}
    metrics = jax.jit(lambda p, b: gradients(plan, p, b)[1])(state.params, b)
    return float(metrics["moe_dropped_fraction"])


def balance(model, corpus, steps: int, batch_size: int = 16, seq_len: int = 64) -> list[dict]:
    """Each of `BALANCINGS` trained `steps` steps on one device from the same seed and
    batches."""
    rows = []
    for name, change in BALANCINGS.items():
        plan = common.simple_plan(dataclasses.replace(model, **change),
                                  build_mesh("dp=1", jax.devices()[:1]), lr=3e-3, steps=steps)
        state, step, history = init_state(plan, 0), make_train_step(plan), []
        for i in range(steps):
            state, metrics = step(state, data.global_batch(corpus.train, 0, i, batch_size,
                                                           seq_len, plan.batch_sharding))
            history.append((float(metrics["moe_load_imbalance"]), float(metrics["ce_loss"])))
        imbalance, ce = (float(v) for v in np.mean(history[-10:], axis=0))
        rows.append({"balancing": name, "imbalance": imbalance, "ce_loss": ce})
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--target", default="h100-80gb")
    parser.add_argument("--balance-steps", type=int, default=100)
    parser.add_argument("--scale-layouts", default="ep8,best16,fsdp-ep")
    args = parser.parse_args()
    base = get_preset("moe-small")
    corpus = data.load_corpus(None, args.seq_len)
    batch = data.host_batch(corpus.train, 0, 0, args.batch_size, args.seq_len)
    volume = [all_to_all_volume(dataclasses.replace(base, moe_routing=r, capacity_factor=c),
                                args.batch_size, args.seq_len)
              for r, c in (("dropless", 1.25), ("capacity", 1.0), ("capacity", 2.0))]
    ep, replicated = steps_per_sec(base, f"ep={N}", batch), steps_per_sec(base, f"dp={N}", batch)
    drops = [{"capacity_factor": c, "dropped_fraction": dropped_fraction(
        dataclasses.replace(base, moe_routing="capacity", capacity_factor=c), batch)}
        for c in (0.5, 1.0, 1.25, 1.5, 2.0)]
    scale = [] if args.target == "none" else [
        r for name in expert_matmuls.SHAPES for r in expert_matmuls.measure(name, args.target)]
    balanced = balance(base, corpus, args.balance_steps) if args.balance_steps else []
    layouts = [] if args.target == "none" or args.scale_layouts == "none" else \
        args.scale_layouts.split(",")
    at_scale = moe_at_scale.measure(args.target, layouts) if layouts else None
    result = {"all_to_all": volume, "ep_steps_per_sec": ep, "replicated_steps_per_sec": replicated,
              "ep_vs_replicated": ep / replicated, "dropped": drops, "at_scale": scale,
              "balancing": balanced, "qwen3_30b_a3b": at_scale}
    common.emit(result, args.json, lambda: [
        f"moe-small: E={base.n_experts}, k={base.top_k}, {N} devices, batch "
        f"{args.batch_size} x {args.seq_len}", "", *common.table(volume, VOLUME),
        f"\nsteps/s: expert-parallel ep={N} {ep:.3f}, experts replicated dp={N} "
        f"{replicated:.3f}, ratio {ep / replicated:.2f}", "", *common.table(drops, DROPS),
        *([f"\nexperts of one layer on one {args.target} (GPU compiler), forward + backward:",
           *common.table(scale, expert_matmuls.COLUMNS)] if scale else []),
        *([f"\nbalancing, {args.balance_steps} steps on one device (mean of the last 10):",
           *common.table(balanced, BALANCE)] if balanced else []),
        *(["", *moe_at_scale.lines(at_scale, args.target)] if at_scale else [])])


if __name__ == "__main__":
    main()
