"""Mixture of experts on 8 simulated devices (`moe-small`).

1. All-to-all bytes of one MoE layer's forward pass per device, read off the compiled
   HLO, against the analytical volume tokens x k x d_model x bytes x 2 directions x (N-1)/N.
   Buffers are padded to capacity (capacity routing: factor x the even share; dropless:
   room for every token), so the ratio should equal the capacity factor, or E/k.
2. Step time of expert parallelism (ep=8) against experts replicated on every device
   (dp=8), timed in one run.
3. The fraction of dropped assignments as the capacity factor varies.

    python benchmarks/moe.py [--batch-size 32] [--seq-len 128] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp

from jdist import data
from jdist.hlo import collective_bytes, loop_bodies
from jdist.mesh import build_mesh
from jdist.rules import DEFAULT_RULES
from jdist.step import init_state, make_optimizer, make_plan, make_train_step
from jdist.step.build import gradients, make_eval_step
from models import get_preset

N = 8


def plan_for(model, mesh: str):
    tx, _ = make_optimizer(1e-3, 10, 1)
    return make_plan(model, build_mesh(mesh), DEFAULT_RULES, tx)


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
    state, m = step(state, b)  # compile + warm up
    jax.block_until_ready(m)
    start = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, b)
    jax.block_until_ready(m)
    return steps / (time.perf_counter() - start)


def dropped_fraction(model, batch) -> float:
    plan = plan_for(model, f"ep={N}")
    state = init_state(plan, 0)
    b = {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}
    metrics = jax.jit(lambda p, b: gradients(plan, p, b)[1])(state.params, b)
    return float(metrics["moe_dropped_fraction"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", action="store_true")
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
    result = {"all_to_all": volume, "ep_steps_per_sec": ep, "replicated_steps_per_sec": replicated,
              "ep_vs_replicated": ep / replicated, "dropped": drops}
    if args.json:
        print(json.dumps(result))
        return
    print(f"moe-small: E={base.n_experts}, k={base.top_k}, {N} devices, batch "
          f"{args.batch_size} x {args.seq_len}")
    print(f"\n{'routing':10} {'factor':>6} {'a2a MiB/layer fwd':>18} {'analytical':>11} "
          f"{'ratio':>6}")
    for v in volume:
        print(f"{v['routing']:10} {v['capacity_factor']:6.2f} "
              f"{v['measured_bytes'] / 2**20:18.3f} {v['analytical_bytes'] / 2**20:11.3f} "
              f"{v['ratio']:6.2f}")
    print(f"\nsteps/s: expert-parallel ep={N} {ep:.3f}, experts replicated dp={N} "
          f"{replicated:.3f}, ratio {ep / replicated:.2f}")
    print(f"\n{'capacity factor':>15} {'dropped':>8}")
    for d in drops:
        print(f"{d['capacity_factor']:15.2f} {d['dropped_fraction']:8.3f}")


if __name__ == "__main__":
    main()
