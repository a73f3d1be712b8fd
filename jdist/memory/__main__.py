"""`python -m jdist.memory`: the per-device memory plan of a training configuration,
optionally beside the compiler's numbers and the step's communication (`--measure`,
`jdist.comm`), as a table or JSON."""

from __future__ import annotations

import json
import sys

from jdist import gpu_report
from jdist.comm import comm_table, step_report
from jdist.memory import compile_step, gib, measure, peak, predict, table


def main(argv: list[str] | None = None) -> int:
    from jdist.errors import ConfigError, require
    from jdist.target import prepare_target
    from jdist.train.__main__ import configure_devices
    from jdist.train.config import make_parser

    parser = make_parser("python -m jdist.memory",
                         "Per-device memory plan of a training configuration.")
    parser.add_argument("--measure", action="store_true",
                        help="also compile the step ahead of time and read the compiler's bytes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--peak-breakdown", action="store_true",
                        help="with --measure: what the compiler keeps at the peak, by the "
                             "operation that made it (XLA's live-range report)")
    try:
        args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
        do_measure, as_json = args.pop("measure"), args.pop("json")
        want_breakdown = args.pop("peak_breakdown")
        from jdist.mesh import parse_mesh
        from jdist.train.config import TrainConfig

        config = TrainConfig(**args)
        require(do_measure or not config.target, "--target compiles the step for a GPU; "
                "add --measure")
        require(do_measure or not want_breakdown, "--peak-breakdown reads the compiled step; "
                "add --measure")
        if config.target:
            prepare_target(config.target)
        configure_devices(config.cpu_devices or parse_mesh(config.mesh).n_devices(8))
        from jdist.train.setup import plan_for

        _, plan, _ = plan_for(config)
    except ConfigError as e:
        print(f"jdist: error: {e}", file=sys.stderr)
        return 2
    micro = config.batch_size // config.grad_accum
    predicted = predict(plan, micro, config.seq_len)
    lines: list[str] = []
    compiled = compile_step(plan, config.batch_size, config.seq_len,
                            lines if want_breakdown else None) if do_measure else None
    measured = measure(plan, config.batch_size, config.seq_len, compiled) if do_measure else None
    comm = step_report(compiled, config.mesh, plan.mesh) if do_measure else None
    gpu = gpu_report.step_report(compiled, plan, config.batch_size, config.seq_len) \
        if config.target else None
    if as_json:
        out = {"model": config.model, "mesh": dict(plan.mesh.shape), "zero": config.zero,
               "predicted": predicted.as_dict()}
        if measured:
            out["measured"] = measured.as_dict()
            out["measured_peak"] = peak(compiled)
            out["comm"] = comm.as_dict()
        if want_breakdown:
            out["peak_breakdown"] = lines
        if gpu:
            out["target"] = {"name": config.target, "hosts": config.hosts, **gpu.as_dict()}
        print(json.dumps(out))
    else:
        print(f"model {config.model}, mesh {config.mesh}, zero {config.zero}, "
              f"micro-batch {micro} x {config.seq_len}, remat {config.remat}, "
              f"{plan.compute_dtype.name}" + (f", LoRA rank {plan.model.lora.rank}" if
                                               plan.model.lora else "")
              + (f", base {plan.quantize}" + (" double-quant" if plan.double_quant else "")
                 if plan.quantize != "none" else ""))
        print(table(predicted, measured))
        if compiled is not None:
            where = f"{config.target} GPU compiler" if config.target else "compiled step"
            print(f"{'peak':12} {'':>14} {gib(peak(compiled)):>14}  (arguments + outputs + "
                  f"temporaries, {where})")
            print(gpu_report.table(gpu) if gpu else comm_table(comm))
            if want_breakdown:
                print("\n".join(lines) or "no peak breakdown: the compiler wrote no report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
