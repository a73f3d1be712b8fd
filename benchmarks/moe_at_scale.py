"""Qwen3-30B-A3B's MoE steps on the GPU compiler (deviceless, `--target`): the exposed share
of the all-to-all bytes before and after `--moe-overlap` (its exchanges in pieces,
`jdist.parallel.moe`), and the memory model against the compiled peak under every remat.

The model with 2 layers, bf16, 4096 tokens per sequence, on three layouts: ep=8 (8 x 4096);
the planner's best 16-GPU layout of this model (`jdist.plan.search`, 16 x 4096 on 2 hosts);
fsdp=2,ep=8 (16 x 4096) for fsdp x ep. Each with grouped and padded dropless routing.
Beside the compiled peak, `live`: the most the step's buffers hold at once (XLA's own
account, `jdist.memory.breakdown.live_peak`); the compiled peak lies above it by what the
heap's placement leaves unused.
`--quick` compiles only the memory cells (no `--moe-overlap off` step, no exposed shares);
`--routings`/`--remats` pick cells. Layout `deepseek` is issue 49's cell instead: the
`deepseek-v3` preset on 64 H100s (8 hosts), fsdp=8,ep=8, 64 x 4096, float32, grouped,
`--remat full` (one compile of about 8 minutes on 2 shared cores).
Exposed shares count each MoE layer's first round of `jdist.parallel.expert_rounds` (its
later rounds run only when routing overflows 1.2x the even share; `1 later round` counts
one later round each, as `jdist.tools.gpu_report.step_report` does); `dispatch` the
exchanges before the experts (forward: tokens to them; backward: output gradients to
them), `combine` those after; `planner` is `jdist.plan.cost`'s share (`parallel.moe.
exposed_share`). Under each of `--remats` (best16's flags otherwise the planner's). Imported
by benchmarks/moe.py (section 6), or run alone:

    python benchmarks/moe_at_scale.py [--json] [--target h100-80gb] [--layouts ep8,best16,fsdp-ep]
        [--quick] [--routings grouped,dropless] [--remats none,selective,full]
"""

from __future__ import annotations

import functools
import json
import sys

import common
from common import Column, GiB

MODEL, LAYERS, SEQ = "qwen3-30b-a3b", 2, 4096
FIXED = {"ep8": (["--mesh", "ep=8"], 8, 1), "fsdp-ep": (["--mesh", "fsdp=2,ep=8"], 16, 2)}
# Each layout's model flags: the 2-layer qwen3-30b-a3b in bf16, or all of DeepSeek-V3 in f32.
QWEN = ["--model", MODEL, "--n-layers", str(LAYERS), "--compute-dtype", "bfloat16"]
DEEPSEEK = (["--mesh", "fsdp=8,ep=8"], 64, 8)
ROUTINGS, REMATS = ("grouped", "dropless"), ("none", "selective", "full")
EXPOSED = (Column("layout", "30"), Column("routing", "9"), Column("remat", "10"),
           Column("exposed before", "15.1%", "exposed_before"),
           Column("after", "6.1%", "exposed_after"),
           Column("dispatch: before", "16.1%", "dispatch_before"),
           Column("after", "6.1%", "dispatch_after"),
           Column("combine: before", "15.1%", "combine_before"),
           Column("after", "6.1%", "combine_after"),
           Column("planner: before", "15.1%", "planned_before"),
           Column("after", "6.1%", "planned_after"),
           Column("1 later round: after", "20.1%", "exposed_later_after"),
           Column("a2a GiB", "8.2f", "a2a_bytes", GiB))
# Which side of the experts an exchange is on, from its op name (`models.moe.DISPATCH` and
# COMBINE scopes; a transpose in the backward runs on the other side of the experts).
SIDES = {"dispatch": True, "combine": False}
MEMORY = (Column("layout", "30"), Column("routing", "9"), Column("remat", "10"),
          Column("predicted GiB", "13.2f", "predicted", GiB),
          Column("compiled GiB", "12.2f", "compiled", GiB), Column("comp/pred", "9.3f", "ratio"),
          Column("live GiB", "8.2f", "live", GiB), Column("live/pred", "9.3f", "live_ratio"))


def best_16(target: str) -> tuple[list[str], int, int]:
    """The planner's first layout of the 2-layer model on 16 GPUs (2 hosts), as flags (its
    remat and `--moe-overlap` choices included)."""
    from jdist.config import TrainConfig
    from jdist.plan.profiles import load_profile
    from jdist.plan.search import search

    base = TrainConfig.of(model=MODEL, n_layers=LAYERS, batch_size=16, seq_len=SEQ,
                          compute_dtype="bfloat16", moe_routing="grouped", target=target)
    best = search(base, 16, 2, load_profile(target)).ranked[0].layout.label()
    return ["--mesh", *best.split()], 16, 2


def compiled(flags: list[str], more: list[str], *, batch: int, hosts: int, target: str,
             model: list[str] = QWEN) -> dict:
    """The step of `model` (flags) with `flags` and `more` compiled for `target`: its peak,
    the prediction and the all-to-all rows."""
    flags = [*flags, *more]
    from jdist.config import parse_args
    from jdist.memory import compile_step, peak, predict
    from jdist.memory.breakdown import live_peak
    from jdist.models.moe import DISPATCH
    from jdist.step.from_flags import plan_for
    from jdist.tools import gpu_report, progress

    config = parse_args([*model, "--batch-size", str(batch), "--seq-len", str(SEQ), "--target",
                         target, "--hosts", str(hosts), *flags])
    _, plan, _ = plan_for(config)
    with progress.phase(f"compiling {' '.join(flags)}", "compiled"):
        text = (step := compile_step(plan, batch, SEQ, lines := [])).as_text()

    def exchanges(trips: float = 0.0, only=None):
        rows = [r for r in gpu_report.report(text, plan.mesh, 0, None, trips, only).rows
                if r.kind == "all-to-all" and "expert" in r.axes]
        return rows[0] if rows else gpu_report.Row("all-to-all", ())

    def side(first: bool):
        return lambda rest: (DISPATCH in rest) == (first != ("transpose(" in rest))

    row = {"compiled": peak(step), "predicted": predict(plan, batch, SEQ).total,
           "live": live_peak(lines),
           "exposed": exchanges().exposed, "exposed_later": exchanges(1.0).exposed,
           "a2a_bytes": exchanges().bytes, "planned": planned_share(plan, config, hosts, target),
           **{name: exchanges(only=side(first)).exposed for name, first in SIDES.items()}}
    print(json.dumps({"flags": flags, **row}), file=sys.stderr, flush=True)  # a long run
    return row


def planned_share(plan, config, hosts: int, target: str) -> float:
    """The planner's exposed share of the step's expert all-to-alls (`jdist.plan.cost`)."""
    from jdist.memory import predict
    from jdist.plan.cost import expert_exchange
    from jdist.plan.layouts import Layout
    from jdist.plan.profiles import load_profile
    from jdist.plan.search import _estimate, crossing
    from jdist.spmd.mesh import dcn_sizes

    shape = dict(plan.mesh.shape)
    memory = predict(plan, config.data.batch_size, SEQ)
    est = _estimate(Layout(tuple(shape.items())), plan, memory, load_profile(target),
                    crossing(dcn_sizes(shape, {}, hosts)), config)
    rows = [(row.bytes, 1 - h) for (row, _, _), h in zip(est.comm, est.hidden)
            if expert_exchange(row, plan)]
    return sum(b * e for b, e in rows) / max(1, sum(b for b, _ in rows))


def measure(target: str, layouts: list[str], routings=ROUTINGS, remats=REMATS,
            quick: bool = False) -> dict:
    """{"exposed": rows, "memory": rows} over `layouts` (keys of FIXED, best16 or deepseek),
    each under `remats`, `--moe-overlap` off and on;
    `quick`: the memory rows alone (on)."""
    exposed, memory = [], []
    for name in layouts:
        if name == "deepseek":  # issue 49's cell: one routing, one remat
            row = compiled(DEEPSEEK[0], ["--moe-routing", "grouped", "--remat", "full"],
                           batch=DEEPSEEK[1], hosts=DEEPSEEK[2], target=target,
                           model=["--model", "deepseek-v3"])
            memory.append(_memory_row("deepseek-v3 fsdp=8,ep=8 (64)", "grouped", "full", row))
            continue
        flags, batch, hosts = best_16(target) if name == "best16" else FIXED[name]
        label = " ".join(flags[1:])
        for flag in ("--remat", "--moe-overlap"):  # set below
            if flag in flags:
                del flags[flags.index(flag):flags.index(flag) + 2]
        for routing in routings:
            run = functools.partial(compiled, [*flags, "--moe-routing", routing],
                                    batch=batch, hosts=hosts, target=target)
            for remat in remats:
                after = run(["--remat", remat, "--moe-overlap", "on"])
                memory.append(_memory_row(label, routing, remat, after))
                if quick:
                    continue
                before = run(["--remat", remat, "--moe-overlap", "off"])
                exposed.append({"layout": label, "routing": routing, "remat": remat,
                                **{f"{key}_{when}": r[key] for when, r in
                                   (("before", before), ("after", after))
                                   for key in ("exposed", "dispatch", "combine", "planned",
                                               "exposed_later")},
                                "a2a_bytes": after["a2a_bytes"]})
    return {"exposed": exposed, "memory": memory}


def _memory_row(label: str, routing: str, remat: str, row: dict) -> dict:
    return {"layout": label, "routing": routing, "remat": remat, "predicted": row["predicted"],
            "compiled": row["compiled"], "ratio": row["compiled"] / row["predicted"],
            "live": row["live"], "live_ratio": row["live"] / row["predicted"]}


def lines(result: dict, target: str) -> list[str]:
    exposed = [f"{MODEL}, {LAYERS} layers, bf16, x {SEQ} tokens, {target} GPU compiler: "
               "expert all-to-all bytes exposed, --moe-overlap off (before) / on (after)",
               *common.table(result["exposed"], EXPOSED), ""] if result["exposed"] else []
    return [*exposed, f"memory model against the {target}-compiled peak (--moe-overlap on)",
            *common.table(result["memory"], MEMORY)]


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    parser.add_argument("--layouts", default="ep8,best16,fsdp-ep",
                        help="of ep8, best16, fsdp-ep, deepseek")
    parser.add_argument("--routings", default=",".join(ROUTINGS))
    parser.add_argument("--remats", default=",".join(REMATS))
    parser.add_argument("--quick", action="store_true",
                        help="the memory cells alone (no --moe-overlap off step)")
    args = parser.parse_args()
    from jdist.runtime.target import prepare_target

    prepare_target(args.target)
    result = measure(args.target, args.layouts.split(","), args.routings.split(","),
                     args.remats.split(","), args.quick)
    common.emit(result, args.json, lambda: lines(result, args.target))


if __name__ == "__main__":
    common.setup_devices(1, cpu_only=True)
    main()
