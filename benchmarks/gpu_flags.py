"""XLA's GPU scheduling flags on jdist's step, from the GPU compiler (deviceless, `--target`):
collective bytes per step and device, the exposed share (no matmul scheduled between an
asynchronous collective's start and done, weighted by loop trips; `jdist.tools.gpu_report`) and
the compiled peak, for the step as jdist compiles it and with each flag the installed
jaxlib spells (`jdist.runtime.target.candidate_flags`) added as a compile option.

    python benchmarks/gpu_flags.py [--json] [--target h100-80gb] [--cases 8b,70b]

Cases: llama3-8b fsdp=8 ZeRO-3, 8x8192, remat full, bf16, cuDNN attention (8 GPUs); and
llama3.1-70b fsdp=32,tp=2 with sequence parallelism, 128x8192 in 4 accumulated
micro-batches, remat full (64 GPUs on 8 hosts). A flag that does not lower the exposed
share is not worth setting (jdist sets none on jax 0.10.2).
"""

from __future__ import annotations

import common
from common import Column

common.setup_devices(1, cpu_only=True)

CASES = {
    "8b": dict(model="llama3-8b", mesh="fsdp=8", zero=3, batch_size=8, seq_len=8192,
               remat="full", compute_dtype="bfloat16", attention="cudnn"),
    "70b": dict(model="llama3.1-70b", mesh="fsdp=32,tp=2", sequence_parallel=True, zero=3,
                batch_size=128, seq_len=8192, grad_accum=4, remat="full",
                compute_dtype="bfloat16", attention="cudnn", hosts=8),
}
COLUMNS = (Column("case", "5"), Column("flag", "44"), Column("GiB coll", "9.1f", "collective_gib"),
           Column("exposed", "8.1%", "exposed"), Column("peak GiB", "9.2f", "peak_gib"))


def measure(case: str, target: str) -> list[dict]:
    from jdist.config import TrainConfig
    from jdist.memory import lower_step, peak
    from jdist.runtime.target import candidate_flags
    from jdist.step.build import compiler_options
    from jdist.step.from_flags import plan_for
    from jdist.tools import gpu_report

    config = TrainConfig.of(**CASES[case], target=target)
    _, plan, _ = plan_for(config)
    b, s = config.data.batch_size, config.data.seq_len
    lowered = lower_step(plan, b, s)  # once: each flag is another compile of it
    rows = []
    for flag, value in [("(as jdist compiles it)", None), *candidate_flags().items()]:
        options = compiler_options(plan)
        options |= {} if value is None else {flag: value}
        compiled = lowered.compile(options)
        total = gpu_report.step_report(compiled, plan, b, s).total()
        rows.append({"case": case, "flag": flag, "collective_gib": total.bytes / 2**30,
                     "exposed": total.exposed, "peak_gib": peak(compiled) / 2**30})
    return rows


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--target", default="h100-80gb")
    parser.add_argument("--cases", default="8b,70b")
    args = parser.parse_args()
    from jdist.runtime.target import prepare_target

    prepare_target(args.target)
    rows = [r for case in args.cases.split(",") for r in measure(case, args.target)]
    common.emit(rows, args.json, lambda: common.table(rows, COLUMNS))


if __name__ == "__main__":
    main()
