"""`python -m jdist.memory`: the per-device memory plan of a training configuration,
optionally beside the compiler's numbers and the step's communication (`--measure`,
`jdist.tools.comm`), as a table or JSON."""

from __future__ import annotations

import json
import sys

from jdist.memory import compile_and_measure, gib, peak, predict, table
from jdist.tools import gpu_report
from jdist.tools.comm import comm_table, step_report


def make_parser():
    """The training flags (`jdist.config.make_parser`) and this command's own."""
    from jdist import config

    parser = config.make_parser("python -m jdist.memory",
                                "Per-device memory plan of a training configuration.")
    parser.add_argument("--measure", action="store_true",
                        help="also compile the step ahead of time and read the compiler's bytes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--peak-breakdown", action="store_true",
                        help="with --measure: what the compiler keeps at the peak, by the "
                             "operation that made it (XLA's live-range report)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from jdist.errors import ConfigError, require
    from jdist.runtime.compiler_logs import quiet_compiler
    from jdist.runtime.distributed import configure_devices
    from jdist.runtime.target import prepare_target

    quiet_compiler()
    parser = make_parser()
    try:
        args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
        do_measure, as_json = args.pop("measure"), args.pop("json")
        want_breakdown = args.pop("peak_breakdown")
        from jdist.config import TrainConfig
        from jdist.spmd.mesh import parse_mesh

        config = TrainConfig.of(**args)
        target = config.devices.target
        require(do_measure or not want_breakdown, "--peak-breakdown reads the compiled step; "
                "add --measure")
        if target:
            prepare_target(target)
        configure_devices(config.devices.cpu_devices or
                          parse_mesh(config.parallel.mesh).n_devices(8))
        from jdist.step.from_flags import plan_for

        _, plan, _ = plan_for(config)
    except ConfigError as e:
        print(f"jdist: error: {e}", file=sys.stderr)
        return 2
    batch_size, seq_len = config.data.batch_size, config.data.seq_len
    micro = batch_size // config.memory.grad_accum
    predicted = predict(plan, micro, seq_len)
    lines: list[str] = []
    compiled, measured = compile_and_measure(plan, batch_size, seq_len,
                                             lines if want_breakdown else None) \
        if do_measure else (None, None)
    comm = step_report(compiled, config.parallel.mesh, plan.mesh) if do_measure else None
    gpu = gpu_report.step_report(compiled, plan, batch_size, seq_len) \
        if target and do_measure else None
    if as_json:
        out = {"model": config.model.preset, "mesh": dict(plan.mesh.shape),
               "zero": config.memory.zero, "compiler": target or "cpu",
               "predicted": predicted.as_dict()}
        if measured:
            out["measured"] = measured.as_dict()
            out["measured_peak"] = peak(compiled)
            out["comm"] = comm.as_dict()
        if want_breakdown:
            out["peak_breakdown"] = lines
        if gpu:
            out["target"] = {"name": target, "hosts": config.devices.hosts, **gpu.as_dict()}
        print(json.dumps(out))
    else:
        print(f"model {config.model.preset}, mesh {config.parallel.mesh}, zero "
              f"{config.memory.zero}, micro-batch {micro} x {seq_len}, remat "
              f"{config.memory.remat}, {plan.compute.dtype.name}"
              + (f", LoRA rank {plan.model.lora.rank}" if plan.model.lora else "")
              + (f", base {plan.quantize}" + (" double-quant" if plan.double_quant else "")
                 if plan.quantize != "none" else ""))
        # The buffers a step keeps depend on the compiler (jdist.memory.on_gpu): the same
        # flags predict other bytes for a GPU target than for the CPU.
        print(f"predicted for the {target} GPU compiler" if target else
              "predicted for the XLA CPU compiler (a GPU's keeps other buffers: add --target "
              "NAME --hosts N, as python -m jdist.plan prints)")
        print(table(predicted, measured))
        if compiled is not None:
            where = f"{target} GPU compiler" if target else "compiled step"
            print(f"{'peak':12} {'':>14} {gib(peak(compiled)):>14}  (arguments + outputs + "
                  f"temporaries, {where})")
            print(gpu_report.table(gpu) if gpu else comm_table(comm))
            if want_breakdown:
                print("\n".join(lines) or "no peak breakdown: the compiler wrote no report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
