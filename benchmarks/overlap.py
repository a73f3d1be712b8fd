"""Communication hidden behind compute on GPUs, from the GPU compiler (deviceless, `--target`):
for the planner's best layouts of each case, the compiled step's collective bytes per step
and device, the exposed share (no matmul scheduled between an asynchronous collective's start
and done, loops weighted; `jdist.tools.gpu_report`) and the peak, before and after:

  before  each layer's parameters gathered as its iteration starts (`--prefetch off`),
          sequence parallelism's activations gathered and scattered whole
          (`--collective-matmul off`), without jdist's GPU flags (the step as jdist
          compiled it before issue 25)
  after   as jdist compiles it: layer i+1 gathered while layer i computes
          (`jdist.parallel.prefetch`), vocab chunks likewise, SP's activations by
          transfers beside the projections' matmuls (`jdist.parallel.collective_matmul`),
          `jdist.runtime.target.GPU_FLAGS` (with XLA's analytical latency estimator unless
          collective matmuls run over more than two devices: `jdist.step.build.compiler_options`)
  model   the planner's predicted exposed share of the same bytes (`jdist.plan.cost`:
          its per-collective overlap assumption, on the profile), for the ranked layouts
  halves  after, with `--tp-halves` (`jdist.parallel.halves`), where the layout has tensor
          parallelism and at least 4 rows per device and micro-batch (else blank)

    python benchmarks/overlap.py [--json] [--target h100-80gb] [--cases 8b,70b,70b-tp8] [--top 3]

Cases (the issue's acceptance): llama3-8b on 8 GPUs, 64 x 8192; llama3.1-70b on 64 GPUs on 8
hosts, 512 x 8192; the same with fsdp=8,tp=8 fixed. bf16, the planner's ranking
(`jdist.plan.search`) on the target's profile.
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(1, cpu_only=True)

CASES = {  # model, devices, hosts, batch, sequence, fixed axes
    "8b": ("llama3-8b", 8, 1, 64, 8192, {}),
    "70b": ("llama3.1-70b", 64, 8, 512, 8192, {}),
    "70b-tp8": ("llama3.1-70b", 64, 8, 512, 8192, {"fsdp": 8, "tensor": 8}),
}
# Layouts measured beside the planner's, by case: the 70B planner's first choice before
# the prefetching loop counted under tensor parallelism (its memory model now puts it over
# budget), the one with 4 rows per device and micro-batch, where `--tp-halves` applies; the
# fixed fsdp=8,tp=8 mesh without sequence parallelism (Megatron's whole all-reduces), which
# the planner ranked second before it left such layouts to their sequence-parallel twin.
EXTRA = {"70b": ["fsdp=32,tp=2 --remat full --grad-accum 4 --sequence-parallel"],
         "70b-tp8": ["fsdp=8,tp=8 --remat full --grad-accum 32"]}
COLUMNS = (Column("case", "8"), Column("layout", "62"),
           Column("GiB coll", "9.1f", "collective_gib"),
           Column("exp before", "11.1%", "exposed_before"),
           Column("exp after", "10.1%", "exposed_after"),
           Column("exp model", ">10", lambda r: _blank(r["exposed_model"], ".1%")),
           Column("exp halves", ">11", lambda r: _blank(r["exposed_halves"], ".1%")),
           Column("peak before", "12.2f", "peak_before_gib"),
           Column("peak after", "11.2f", "peak_after_gib"),
           Column("peak halves", ">12", lambda r: _blank(r["peak_halves_gib"], ".2f")))


def _blank(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def measure(case: str, target: str, top: int) -> list[dict]:
    from jdist.config import TrainConfig, parse_args
    from jdist.memory import lower_step, peak
    from jdist.parallel.halves import rows_fit
    from jdist.plan.profiles import load_profile
    from jdist.plan.search import search
    from jdist.runtime.target import COMPILER_OPTIONS
    from jdist.spmd.axes import TENSOR
    from jdist.spmd.rules import batch_split
    from jdist.step.build import compiler_options
    from jdist.step.from_flags import plan_for
    from jdist.tools import gpu_report

    model, devices, hosts, batch, seq, fixed = CASES[case]
    base = TrainConfig.of(model=model, batch_size=batch, seq_len=seq, compute_dtype="bfloat16",
                          target=target)
    ranked = search(base, devices, hosts, load_profile(target), fixed).ranked[:top]
    configs = [(e.layout.label(), e.layout.to_config(base), e) for e in ranked]
    configs += [(f"{layout} (not ranked)", parse_args(
        ["--model", model, "--batch-size", str(batch), "--seq-len", str(seq), "--target",
         target, "--compute-dtype", "bfloat16", "--mesh", *layout.split()]), None)
        for layout in EXTRA.get(case, [])]
    rows = []
    for label, config, planned in configs:
        _, plan, _ = plan_for(config.replace(hosts=hosts))
        row = {"case": case, "layout": label,
               "exposed_model": planned.exposed_share if planned else None,
               "rows_model": [{"kind": r.kind, "axes": list(r.axes), "bytes": r.bytes,
                               "exposed": 1 - h}
                              for (r, _, _), h in zip(planned.comm, planned.hidden)]
               if planned else None}
        local_rows = batch // plan.compute.grad_accum // batch_split(plan.mesh.shape, plan.rules)[1]
        halves = plan.mesh.shape[TENSOR] > 1 and rows_fit(local_rows) and not plan.pipeline
        variants = [("before", plan.computing(prefetch="off", collective_matmul="off"),
                     dict(COMPILER_OPTIONS)),
                    ("after", plan, compiler_options(plan))]
        if halves:
            halved = plan.computing(tp_halves=True)
            variants.append(("halves", halved, compiler_options(halved)))
        row["exposed_halves"] = row["peak_halves_gib"] = None
        for when, p, options in variants:
            compiled = lower_step(p, batch, seq).compile(options)
            rep = gpu_report.step_report(compiled, p, batch, seq)
            total = rep.total()
            row |= {f"exposed_{when}": total.exposed, f"peak_{when}_gib": peak(compiled) / 2**30,
                    f"collective_{when}_gib": total.bytes / 2**30,
                    f"rows_{when}": rep.as_dict()["rows"]}  # per kind and axes (JSON)
        row["collective_gib"] = row["collective_after_gib"]
        rows.append(row)
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    parser.add_argument("--cases", default="8b,70b,70b-tp8")
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    from jdist.runtime.target import prepare_target

    prepare_target(args.target)
    rows = [r for case in args.cases.split(",") for r in measure(case, args.target, args.top)]
    common.emit(rows, args.json, lambda: common.table(rows, COLUMNS))


if __name__ == "__main__":
    main()
