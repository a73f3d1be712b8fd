"""The planner's 70B acceptance in one process of 64 simulated CPU devices: plan
llama3.1-70b on 64 H100s over 8 hosts, then run the trainer's own pre-compile checks (every
check `--dry-run` makes before compiling: flags, shapes, the memory fit) on every ranked
layout's command line, and take the memory the trainer predicts for it. Prints one JSON
object: the planner's output, its wall time, the checks' verdict, the trainer's predicted
total of each row."""

import contextlib
import io
import json
import shlex
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 64)

from jdist.config import parse_args  # noqa: E402
from jdist.plan.__main__ import main as plan  # noqa: E402
from jdist.step.from_flags import plan_for  # noqa: E402
from jdist.train.fit import check_fits, plan_breakdown  # noqa: E402

BUDGET_GB = 80e9 * 0.75 / 2**30  # what JAX lets a process allocate on an H100 80GB


def replanned_total(command: str, target: list[str]) -> int:
    """The total the trainer predicts for a `python -m jdist.train` command line, after its
    pre-compile checks (every check `--dry-run` makes, the memory fit included) pass, on
    the devices the planner planned on (`target`: the GPU's compile-only devices, whose
    compiler the memory model follows, as on the GPUs themselves)."""
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "jdist.train"], words
    config = parse_args(words[3:] + ["--device-memory-gb", str(BUDGET_GB)] + target)
    _, train_plan, _ = plan_for(config)
    check_fits(config, train_plan)  # raises ConfigError when it would not fit
    return plan_breakdown(config, train_plan).total


def run() -> dict:
    argv = ["--model", "llama3.1-70b", "--devices", "64", "--hosts", "8", "--accelerator",
            "h100-80gb", "--batch-size", "512", "--seq-len", "8192", "--json", "--top", "20"]
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        status = plan(argv)
    took = time.perf_counter() - start
    result = json.loads(out.getvalue())
    target = ["--target", "h100-80gb", "--hosts", "8"] \
        if "compile-only" in result["planned_on"] else []
    replanned = [replanned_total(row["command"], target) for row in result["layouts"]]
    return {"status": status, "seconds": took, "plan": result, "checks": "passed",
            "replanned_totals": replanned}


if __name__ == "__main__":
    print(json.dumps(run()))
    sys.exit(0)
