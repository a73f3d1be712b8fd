"""Pipeline schedules: the bubble fraction of the executed schedule next to its formula, and
peak per-device temporary bytes of the compiled step, for gpipe, 1f1b, interleaved and the
zero-bubble zb-h1 and zbv; then
the executed FLOPs of a pipelined step against the unpipelined one's; and each schedule's
step time at P=4, M=8 against 1f1b's.

    python benchmarks/pipeline.py [--stages 2 4] [--factors 1 2 4 8] [--micro-batch 4]
                                  [--seq-len 128] [--n-layers 8] [--flops-model small]
                                  [--time-steps 5] [--target h100-80gb|none] [--json]

The micro-batch size is fixed, so M micro-batches make a global batch of M x micro-batch:
the activations of one micro-batch cost the same in every row, and what changes with M is
how many of them a schedule keeps alive. Target: bubble = (P-1)/(V*M+P-1) exactly; 1f1b's
temp bytes flat in M, gpipe's growing linearly. The last columns read the compiled step's
collectives (per device, loop bodies times their trip counts): activation/cotangent
collective-permutes, and everything else (the embedding/head gradient sum over stage only:
block parameters and gradients never leave their stage, interleaved included). The steps
run `--remat none`: a backward reads its forward's residuals, held for `stashed` micro-batches
(the chunk inputs, freed by the forward, in `inputs`; zero-bubble micro-batches whose
residuals the weight gradient reads in `read by W`, those whose hand-over awaits it in
`awaiting W`; zbv counts half-size chunks). `weighted` is the
bubble of the executed lockstep ticks, each as long as its slowest operation (F 1, a whole
backward 2, split B and W 1 each): the share of time a stage idles
(`jdist.plan.cost.pipeline_bubble`). Target: zb-h1's at most a third of 1f1b's, zbv's
less again.

FLOPs: the matmul FLOPs the compiled step executes (`jdist.tools.gpu_report`: loops by their trip
counts, the stage program's branches by the schedule's share of ticks), summed over devices,
for `--flops-model` on pp=4 (8 micro-batches): 1f1b under `--remat none` (the stash) and
`full` (each chunk recomputed from its input), and 1f1b and zb-h1 under `selective` (zb-h1's
backward split in two, `jdist.parallel.pipeline.split_backward`), each against one device's step
under the same remat (`full` against `none`'s) over the same global batch. Target: the stash
within 3% of the unpipelined step, and zb-h1 no more than 1f1b. On the CPU compiler, and with
`--target` (default where jax's CUDA plugin is installed) on the GPU compiler too, which
runs in a subprocess (`python -m jdist.memory --measure --target`: one backend per process).
"""

from __future__ import annotations

import common
from common import Column, MiB

common.setup_devices(8)

import json
import subprocess
import sys

import jax
import jax.numpy as jnp

from jdist import data
from jdist.memory import compile_step
from jdist.models import get_preset
from jdist.parallel.pipeline import PipelineConfig
from jdist.plan.cost import pipeline_bubble
from jdist.spmd.mesh import build_mesh
from jdist.step import init_state, make_train_step
from jdist.step.state import with_pipeline
from jdist.tools import gpu_report
from jdist.tools.hlo import executed_collective_bytes

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2))
COLUMNS = (Column("P", ">2", "stages"), Column("M", ">3", "micro"),
           Column("schedule", "14", lambda r: r["schedule"] + (f" V={r['virtual']}"
                                                               if r["virtual"] > 1 else "")),
           Column("ticks", ">5"), Column("bubble", "7.4f"),
           Column("formula", "7.4f", "bubble_formula"),
           Column("weighted", "8.4f", "weighted_bubble"), Column("stashed", ">7"),
           Column("inputs", ">6"), Column("read by W", ">9", "read_by_w"),
           Column("awaiting W", ">10", "awaiting_w"),
           Column("temp MiB", "9.2f", "temp_bytes", MiB),
           Column("permute MiB", "11.2f", "permute_bytes", MiB),
           Column("other MiB", "9.2f", "other_collective_bytes", MiB))


def measure(model, stages: int, micro: int, schedule: str, virtual: int, micro_batch: int,
            seq_len: int) -> dict:
    """Compile one pipelined step ahead of time (nothing is allocated) and read its table."""
    mesh = build_mesh(f"pp={stages}", jax.devices()[:stages])
    config = PipelineConfig(schedule, micro, virtual)
    plan = with_pipeline(common.simple_plan(model, mesh), config)
    tokens = jax.ShapeDtypeStruct((micro * micro_batch, seq_len), jnp.int32)
    compiled = make_train_step(plan).lower(
        plan.abstract, {"inputs": tokens, "targets": tokens}).compile()
    table = config.table(stages, stash=True)
    moved = executed_collective_bytes(compiled.as_text())
    permute = moved.pop("collective-permute")
    return {"schedule": schedule, "stages": stages, "micro": micro, "virtual": virtual,
            "ticks": table.ticks, "bubble": table.bubble_fraction(),
            "bubble_formula": table.expected_bubble(),
            "weighted_bubble": pipeline_bubble(table, plan.compute.remat),
            "stashed": table.n_res_slots, "inputs": table.n_slots,
            "read_by_w": table.n_w_slots, "awaiting_w": table.n_h_slots,
            "temp_bytes": common.temp_bytes(compiled),
            "permute_bytes": permute, "other_collective_bytes": sum(moved.values())}


FLOPS_COLUMNS = (Column("compiler", "8"), Column("step", "29"),
                 Column("TFLOP", ">10.4f", "flops", 1e12),
                 Column("vs unpipelined", ">14.3f", "ratio"))
# (row, mesh, remat, schedule): each pipelined row against the unpipelined step under its
# remat (`full` against `none`'s: what recomputing costs over the stash).
FLOPS_STEPS = (("unpipelined, remat none", "dp=1", "none", None),
               ("pp=4 1f1b, remat none", "pp=4", "none", "1f1b"),
               ("pp=4 1f1b, remat full", "pp=4", "full", "1f1b"),
               ("unpipelined, remat selective", "dp=1", "selective", None),
               ("pp=4 1f1b, remat selective", "pp=4", "selective", "1f1b"),
               ("pp=4 zb-h1, remat selective", "pp=4", "selective", "zb-h1"))


def flops_cpu(model_name: str, mesh_text: str, remat: str, schedule: str | None, batch: int,
              seq_len: int) -> float:
    """Executed matmul FLOPs of the step on all devices, CPU compiler (in this process)."""

    n = 1 if mesh_text == "dp=1" else 4
    plan = common.simple_plan(get_preset(model_name), build_mesh(mesh_text, jax.devices()[:n]))
    plan = plan.computing(remat=remat)
    if n > 1:
        plan = with_pipeline(plan, PipelineConfig(schedule, 8))
    compiled = compile_step(plan, batch, seq_len)
    return n * gpu_report.step_report(compiled, plan, batch, seq_len).executed_flops


def flops_gpu(target: str, model_name: str, mesh_text: str, remat: str, schedule: str | None,
              batch: int, seq_len: int) -> float:
    """The same on the GPU compiler (deviceless `target`), from `jdist.memory`'s report."""
    args = ["--model", model_name, "--mesh", mesh_text, "--batch-size", str(batch),
            "--seq-len", str(seq_len), "--remat", remat, "--compute-dtype", "bfloat16",
            "--measure", "--json", "--target", target]
    if mesh_text != "dp=1":
        args += ["--pp-schedule", schedule, "--microbatches", "8"]
    out = subprocess.run([sys.executable, "-m", "jdist.memory", *args], check=True,
                         capture_output=True, text=True, cwd=common.ROOT).stdout
    report = json.loads(out)
    return report["target"]["executed_flops"] * (1 if mesh_text == "dp=1" else 4)


def flops_rows(model_name: str, target: str | None, batch: int, seq_len: int) -> list[dict]:
    rows = []
    for compiler in ("cpu", *([target] if target else [])):
        base = {}
        for step, mesh_text, remat, schedule in FLOPS_STEPS:
            measure_flops = flops_cpu if compiler == "cpu" else \
                lambda *a: flops_gpu(target, *a)
            flops = measure_flops(model_name, mesh_text, remat, schedule, batch, seq_len)
            if schedule is None:
                base[remat] = flops
            rows.append({"compiler": compiler, "step": step, "flops": flops,
                         "ratio": flops / base.get(remat, base["none"])})
    return rows


TIME_COLUMNS = (Column("schedule", "14"), Column("step s", ">8.4f", "step_s"),
                Column("vs 1f1b", ">8.3f", "ratio"),
                Column("weighted bubble", ">15.4f", "weighted_bubble"))


def timing_rows(model, stages: int, micro: int, micro_batch: int, seq_len: int,
                steps: int) -> list[dict]:
    """Each schedule's step, run `steps` times on the CPU mesh after a warm-up; seconds
    per step and the ratio to 1f1b's, measured in this one run."""
    corpus = data.load_corpus(None, seq_len)
    rows = []
    for schedule, virtual in SCHEDULES:
        mesh = build_mesh(f"pp={stages}", jax.devices()[:stages])
        config = PipelineConfig(schedule, micro, virtual)
        plan = with_pipeline(common.simple_plan(model, mesh), config)
        batch = data.global_batch(corpus.train, 0, 0, micro * micro_batch, seq_len,
                                  plan.batch_sharding)
        step = make_train_step(plan)
        seconds = common.time_steps(step, init_state(plan, 0), [batch], steps)[2]
        rows.append({"schedule": schedule + (f" V={virtual}" if virtual > 1 else ""),
                     "step_s": seconds / steps, "weighted_bubble": pipeline_bubble(
                         config.table(stages, stash=True), plan.compute.remat)})
    base = next(r["step_s"] for r in rows if r["schedule"] == "1f1b")
    for r in rows:
        r["ratio"] = r["step_s"] / base
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="micro-batch counts as multiples of the stage count")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--flops-model", default="small")
    parser.add_argument("--time-steps", type=int, default=5,
                        help="timed steps per schedule at P=4, M=8 (0: skip)")
    common.add_target(parser, "also count the FLOPs section's matmuls on this GPU's compiler")
    args = parser.parse_args()
    target = common.requested_target(parser, args)
    model = get_preset("tiny", n_layers=args.n_layers)
    rows = [measure(model, p, f * p, name, v, args.micro_batch, args.seq_len)
            for p in args.stages for f in args.factors for name, v in SCHEDULES]
    flops = flops_rows(args.flops_model, target, 8 * args.micro_batch, args.seq_len)
    timed = timing_rows(model, 4, 8, args.micro_batch, args.seq_len, args.time_steps) \
        if args.time_steps else []
    result = {"micro_batch": args.micro_batch, "seq_len": args.seq_len,
              "n_layers": args.n_layers, "rows": rows, "flops_model": args.flops_model,
              "flops": flops, "timing": timed}
    common.emit(result, args.json, lambda: [
        f"tiny ({args.n_layers} layers), micro-batch {args.micro_batch} x {args.seq_len} "
        "tokens, float32; temp = compiled peak per-device temporaries",
        *common.table(rows, COLUMNS), "",
        f"executed matmul FLOPs per step, all devices: {args.flops_model}, batch "
        f"{8 * args.micro_batch} x {args.seq_len}",
        *common.table(flops, FLOPS_COLUMNS),
        *(["", f"step time on the CPU mesh, pp=4, M=8 ({args.time_steps} steps each; the "
           "simulated devices share this machine's cores, so an idle stage's core runs "
           "another stage's work: the ratio shows executed work, not the bubble)",
           *common.table(timed, TIME_COLUMNS)] if timed else [])])


if __name__ == "__main__":
    main()
