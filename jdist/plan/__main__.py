"""`python -m jdist.plan`: rank the layouts of a model on N devices of an accelerator, and
print the best as a `python -m jdist.train` command line. `python -m jdist.plan calibrate`
measures the `cpu-sim` profile on this machine (`jdist.plan.calibrate`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from jdist.errors import ArgumentParser, ConfigError, require, run_cli
from jdist.plan import emit
from jdist.runtime.compiler_logs import quiet_compiler
from jdist.tools import progress


def make_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m jdist.plan",
                description="Choose the parallel layout of a training run before renting "
                            "hardware (calibrate: python -m jdist.plan calibrate).")
    p.add_argument("--model", required=True,
                   help="a preset (llama3.1-70b, small, ...) or a Hugging Face model directory "
                        "or config.json")
    p.add_argument("--devices", type=int, required=True, help="accelerators in all")
    p.add_argument("--hosts", type=int, default=0,
                   help="hosts they sit on (default: devices / the profile's devices per host)")
    p.add_argument("--accelerator", required=True,
                   help="profile: h100-80gb, h200-141gb, a100-80gb, cpu-sim (jdist/plan/"
                        "profiles.toml)")
    p.add_argument("--batch-size", type=int, required=True, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--fix", action="append", default=[],
                   help="pin axis sizes, e.g. --fix tp=8 --fix pp=1 (repeatable)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on accelerators, float32 on cpu-sim")
    p.add_argument("--memory-gb", type=float, default=0.0,
                   help="per-device memory a process may use, in GiB (2**30 bytes, as "
                        "train's --device-memory-gb and every memory figure jdist prints; "
                        "default: the profile's memory_gb x usable_memory_fraction)")
    p.add_argument("--moe-routing", choices=["dropless", "grouped", "capacity"], default=None,
                   help="a mixture of experts' routing path (default: the model's)")
    p.add_argument("--lora-rank", type=int, default=None, help="plan LoRA fine-tuning")
    p.add_argument("--quantize-base", choices=["none", "nf4"], default="none",
                   help="nf4: plan QLoRA (a 4-bit base)")
    p.add_argument("--double-quant", action="store_true",
                   help="with --quantize-base nf4: also quantize the block maxima")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="compile the best layouts for the accelerator with the GPU compiler "
                        "(deviceless; needs the cuda12 extra) until K fit: compiled memory "
                        "against the budget, exposed communication instead of the assumed "
                        "overlap")
    p.add_argument("--emit", choices=["slurm", "jobset"], default=None,
                   help="also write the best layout as a multi-host launch: an sbatch script "
                        "or a Kubernetes JobSet manifest (one process per host)")
    p.add_argument("--out", default="",
                   help="with --emit: the file to write (default: jdist-MODEL.sbatch or "
                        ".yaml here)")
    return p


def base_config(args):
    """The TrainConfig every layout shares: model, batch, sequence, dtype, fine-tuning."""
    from jdist.config import TrainConfig

    dtype = args.compute_dtype
    if dtype == "auto":
        dtype = "float32" if args.profile.name == "cpu-sim" else "bfloat16"
    model = {"model": args.model}
    if os.path.exists(args.model):
        path = args.model[:-len("config.json")] if args.model.endswith("config.json") \
            else args.model
        model = {"init_from": path or "."}
    if args.moe_routing:
        model["moe_routing"] = args.moe_routing
    # On a GPU target the hosts lay the compile-only devices out (as `--verify` compiles).
    where = {"target": args.target, "hosts": args.hosts} if args.target else {}
    return TrainConfig.of(**model, batch_size=args.batch_size, seq_len=args.seq_len,
                          compute_dtype=dtype, lora_rank=args.lora_rank,
                          quantize_base=args.quantize_base, double_quant=args.double_quant,
                          **where)


def command(base, layout) -> str:
    head = ["python -m jdist.train"]
    head += [f"--init-from {base.model.init_from}"] if base.model.init_from else \
        [f"--model {base.model.preset}"]
    head += [f"--batch-size {base.data.batch_size}", f"--seq-len {base.data.seq_len}",
             f"--compute-dtype {base.memory.compute_dtype}"]
    if base.model.moe_routing is not None:
        head.append(f"--moe-routing {base.model.moe_routing}")
    if base.finetune.lora_rank is not None:
        head.append(f"--lora-rank {base.finetune.lora_rank}")
    if base.finetune.quantize_base != "none":
        head.append(f"--quantize-base {base.finetune.quantize_base}")
    if base.finetune.double_quant:
        head.append("--double-quant")
    return " ".join(head + layout.flags())


def memory_command(base, layout) -> str:
    """The `python -m jdist.memory` line whose predicted total is the planner's figure for
    `layout`: the same flags, on the devices the planner planned on (a GPU target's compiler
    keeps other buffers than the CPU's, so without `--target` the total differs)."""
    where = f" --target {base.devices.target} --hosts {base.devices.hosts}" \
        if base.devices.target else ""
    return command(base, layout).replace("jdist.train", "jdist.memory", 1) + where


def table(ranked, top: int) -> str:
    width = max(len(e.layout.label()) for e in ranked[:top])
    lines = [f"{'#':>3} {'layout':{width}} {'GiB/dev':>7} {'step s':>9} {'tokens/s':>11} "
             f"{'MFU':>6}  bottleneck"]
    for i, e in enumerate(ranked[:top], 1):
        lines.append(f"{i:3d} {e.layout.label():{width}} {e.memory.total / 2**30:7.2f} "
                     f"{e.step_s:9.4g} {e.tokens_per_s:11.4g} {e.mfu:6.1%}  {e.bottleneck}")
    return "\n".join(lines)


def as_json(e, base) -> dict:
    return {"layout": e.layout.label(), "flags": e.layout.flags(),
            "memory": e.memory.as_dict(), "step_s": e.step_s, "tokens_per_s": e.tokens_per_s,
            "mfu": e.mfu, "bottleneck": e.bottleneck, "compute_s": e.compute_s,
            "memory_bound_s": e.memory_bound_s, "comm_s": e.comm_s, "bubble": e.bubble,
            "flops_per_device": e.flops, "command": command(base, e.layout),
            "memory_command": memory_command(base, e.layout)}


def simulate_devices(n: int) -> None:
    """Plan on n simulated CPU devices (the plans are abstract: nothing is allocated), unless
    the caller configured a count already (the tests' processes keep their 8)."""
    import jax

    from jdist.runtime.distributed import configure_devices
    if jax.config.jax_num_cpu_devices == -1:
        configure_devices(n)


def checked_args(argv: list[str]):
    """The flags, checked before anything is searched: (args, the --fix axes, the file
    --emit writes or None)."""
    from jdist.plan.profiles import load_profile
    from jdist.runtime.target import GPUS, check_plugin
    from jdist.spmd.mesh import parse_axes

    args = make_parser().parse_args(argv)
    args.profile = load_profile(args.accelerator)
    require(args.devices >= 1, f"--devices {args.devices} must be at least 1")
    hosts = args.hosts = args.hosts or max(1, args.devices // args.profile.devices_per_host)
    require(args.devices % hosts == 0,
            f"--devices {args.devices} do not split evenly over --hosts {hosts}; give a "
            "multiple of the host count")
    require(not args.out or args.emit, "--out names the file --emit writes; add --emit "
            "slurm or --emit jobset")
    emit_to = emit.out_path(args.emit, args.out, args.model) if args.emit else None
    fixed = {}
    for text in args.fix:
        fixed.update(parse_axes(text))
    require(all(n >= 1 for n in fixed.values()), "--fix takes positive sizes, e.g. --fix tp=8")
    require(args.devices % math.prod(fixed.values()) == 0,
            f"--fix {','.join(args.fix)} uses {math.prod(fixed.values())} devices, which does not "
            f"divide --devices {args.devices}")
    require(args.verify >= 0, f"--verify {args.verify} must be at least 0")
    require(not args.verify or args.profile.name in GPUS,
            f"--verify compiles for a GPU target; {args.profile.name} has none (use one of "
            f"{', '.join(GPUS)})")
    if args.verify:
        check_plugin()
    return args, fixed, emit_to


def prepare_devices(args) -> None:
    """The trainer plans on the target GPU's compile-only devices where the CUDA plugin is
    installed (attention `auto` resolves as on that GPU: cuDNN), else on simulated CPUs."""
    from jdist.plan.search import GROWTH
    from jdist.runtime.target import GPUS, plugin_installed, prepare_target

    args.target = args.profile.name if args.profile.name in GPUS and plugin_installed() \
        else ""
    if args.target:
        prepare_target(args.target)
    else:
        simulate_devices(args.devices * GROWTH)  # before jax starts its backends


def nothing_fits(args, base, result, fixed, budget) -> ConfigError:
    """The error when no layout fits: the most frugal one's need, and the smallest change
    that fits (searched again) when no axis was fixed."""
    from jdist.plan.search import HEADROOM, smallest_change

    need = ""
    if result.smallest:
        need = (f" (the most frugal, {result.smallest[1].label()}, needs "
                f"{result.smallest[0] / 2**30:.1f} GiB)")
    changes = []
    if not fixed:
        with progress.phase("nothing fits: searching again with more devices, a shorter "
                            "sequence and QLoRA", "searched for a change that fits"):
            changes = smallest_change(base, args.devices, args.hosts, args.profile)
    fix = ("it fits with " + ", or ".join(changes)) if changes else \
        "use more devices, a shorter --seq-len, a smaller --batch-size or QLoRA"
    budget_gib = (budget or args.profile.usable_memory_bytes * HEADROOM) / 2**30
    return ConfigError(f"no layout of {args.model} on {args.devices} {args.profile.name} "
                       f"devices fits in {budget_gib:.1f} GiB per device{need}; {fix}")


def verified_best(args, base, result, budget):
    """(the best layout that fits once the GPU compiler lays it out, every verified row)."""
    from jdist.plan import verify
    from jdist.plan.search import HEADROOM

    with progress.Counter(f"compiling the best layouts for {args.devices} x {args.target} "
                          f"until {args.verify} fit", every=0) as counter:
        verified = verify.verify(
            result.ranked, args.verify, base, args.hosts, args.profile,
            budget or args.profile.usable_memory_bytes * HEADROOM,
            lambda n, m, label: counter.at(n, m, f"compiling {label}"))
    fitting = [v for v in verified if v.fits]
    if not fitting:
        print(verify.table(verified), file=sys.stderr)
        raise ConfigError(
            f"none of the {len(verified)} best layouts fits once the GPU compiler lays it "
            "out (table above); rerun with a larger --verify, or a --memory-gb below the "
            "budget to leave room")
    return fitting[0].verified, verified


def write_emitted(args, base, best, emit_to) -> None:
    from jdist.runtime.target import GPUS

    summary = (f"{args.model} on {args.devices} x {args.profile.name}, {args.hosts} hosts: "
               f"{best.layout.label()}, predicted {best.step_s:.3g} s/step")
    gpus = args.devices // args.hosts if args.profile.name in GPUS else 0
    emit.write(emit_to, emit.render(args.emit, command(base, best.layout),
                                    model=args.model, hosts=args.hosts, gpus_per_host=gpus,
                                    step_s=best.step_s, summary=summary))


def print_json(args, base, result, best, verified, emit_to, took, devices) -> None:
    out = {"model": args.model, "devices": args.devices, "hosts": args.hosts,
           "accelerator": args.profile.name, "planned_on": devices,
           "batch_size": args.batch_size, "seq_len": args.seq_len, "search_s": took,
           "layouts": [as_json(e, base) for e in result.ranked[:args.top]],
           "command": command(base, best.layout),
           "memory_command": memory_command(base, best.layout)}
    if verified:
        from jdist.plan.verify import as_json as verified_json
        out["verified"] = [verified_json(v) for v in verified]
    if emit_to:
        out["emitted"] = str(emit_to)
    print(json.dumps(out))


def print_text(args, base, result, best, verified, emit_to, took, devices, budget) -> None:
    from jdist.plan.search import HEADROOM, describe_counts

    hosts = args.hosts
    print(f"{args.model} on {args.devices} x {args.profile.name} ({hosts} host"
          f"{'s' if hosts > 1 else ''}), batch "
          f"{args.batch_size} x {args.seq_len}, {base.memory.compute_dtype}: "
          f"{describe_counts(result)} "
          f"({took:.1f} s, planned on {devices})")
    print(table(result.ranked, args.top))
    if verified:
        from jdist.plan.verify import table as verified_table
        print(f"\nthe best {len(verified)} compiled for {args.devices} x {args.target} by the "
              f"GPU compiler ({sum(v.compile_s for v in verified):.0f} s) until {args.verify} "
              "fit the budget; verified ranking (fits: compiled peak within the budget of "
              f"{(budget or args.profile.usable_memory_bytes * HEADROOM) / 2**30:.1f} GiB):")
        print(verified_table(verified))
    print(f"\nbest: {command(base, best.layout)}")
    print(f"its memory, term by term (the same GiB/dev): {memory_command(base, best.layout)}")
    if emit_to:
        print(emit.how_to_run(args.emit, emit_to))


def plan_main(argv: list[str]) -> int:
    args, fixed, emit_to = checked_args(argv)
    prepare_devices(args)
    from jdist.plan.search import HEADROOM, search

    base = base_config(args)
    budget = args.memory_gb * 2**30 * HEADROOM if args.memory_gb else None
    start = time.perf_counter()
    with progress.Counter(f"searching the layouts of {args.model} on {args.devices} "
                          "devices, by mesh shape") as counter:
        result = search(base, args.devices, args.hosts, args.profile, fixed, budget,
                        lambda n, m, r: counter.at(n, m, f"{r.considered} planned, "
                                                         f"{len(r.ranked)} fit"))
    took = time.perf_counter() - start
    if not result.ranked:
        raise nothing_fits(args, base, result, fixed, budget)
    best, verified = result.ranked[0], []
    if args.verify:
        best, verified = verified_best(args, base, result, budget)
    if emit_to:
        write_emitted(args, base, best, emit_to)
    devices = f"{args.target} compile-only devices" if args.target else \
        "simulated CPU devices (install the cuda12 extra to plan on the GPU's own)"
    if args.json:
        print_json(args, base, result, best, verified, emit_to, took, devices)
    else:
        print_text(args, base, result, best, verified, emit_to, took, devices, budget)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_compiler()
    if argv[:1] == ["calibrate"]:
        from jdist.plan.calibrate import main as calibrate
        return calibrate(argv[1:])
    return run_cli(lambda: plan_main(argv))


if __name__ == "__main__":
    sys.exit(main())
