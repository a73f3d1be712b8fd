"""Does a run fit? The memory plan (`jdist.memory`) against the device's budget, checked
before anything is allocated, with a suggestion when it does not; and `--dry-run`."""

from __future__ import annotations

from jdist.errors import ConfigError
from jdist.memory import Breakdown, compile_and_measure, gib, peak, predict, table
from jdist.step.from_flags import plan_for
from jdist.tools import gpu_report
from jdist.tools.comm import comm_table, step_report


def suggest(config, budget: int) -> str:
    """The first of a few standard changes whose predicted total fits in `budget` bytes."""

    candidates = []
    for zero in range(config.memory.zero + 1, 4):
        candidates.append((f"--zero {zero}", {"zero": zero}))
    if config.memory.remat in ("none", "everything_saveable"):
        candidates += [("--remat selective", {"remat": "selective"}),
                       ("--remat full", {"remat": "full"})]
    candidates += [(f"--zero 3 --remat full --grad-accum {config.memory.grad_accum * k}",
                    {"zero": 3, "remat": "full", "grad_accum": config.memory.grad_accum * k})
                   for k in (2, 4, 8)]
    for flags, change in candidates:
        trial = config.replace(**change)
        try:
            _, plan, _ = plan_for(trial)
        except ConfigError:  # e.g. the batch no longer splits: not a suggestion
            continue
        data = trial.data
        need = predict(plan, data.batch_size // trial.memory.grad_accum, data.seq_len).total
        if need <= budget:
            return f"{flags} (predicted {need / 2**30:.2f} GiB)"
    return "more fsdp or tensor parallelism (a larger mesh), or a smaller model"


def device_budget(config) -> int | None:
    """Per-device memory limit: --device-memory-gb, else what the accelerator reports."""
    import jax

    if config.memory.device_memory_gb:
        return int(config.memory.device_memory_gb * 2**30)
    if config.devices.target:  # what JAX lets one process allocate on that GPU
        from jdist.plan.profiles import load_profile
        return int(load_profile(config.devices.target).usable_memory_bytes)
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


# `--offload auto` tries these in order: each moves more state to the host, and costs more
# host traffic per step (the optimizer state twice; then every layer's parameters in the
# forward and backward and its gradient back); last the disk (the optimizer state read and
# written a layer at a time, at the disk's bandwidth), for what params cannot run or fit.
OFFLOADS = ("none", "optimizer", "params", "disk")


def resolve_offload(config):
    """`--offload auto`: the first of `OFFLOADS` whose predicted memory fits the device
    (`device_budget`; none when there is no budget, as on a CPU), else the one that needs
    least (the fit check then says what more is needed). JAX cannot page state to the host
    under memory pressure (every buffer's memory space is fixed when the step compiles), so
    this is chosen once, before the step compiles. One line says what was chosen."""
    if config.memory.offload != "auto":
        return config
    budget, tried = device_budget(config), {}
    for mode in OFFLOADS if budget else OFFLOADS[:1]:
        trial = config.replace(offload=mode)
        try:
            _, plan, _ = plan_for(trial)
        except ConfigError:  # a mode this run cannot use (e.g. params with pp)
            continue
        tried[mode] = plan_breakdown(trial, plan).total
        if not budget or tried[mode] <= budget:
            break
    fitting = [m for m in tried if not budget or tried[m] <= budget]
    choice = fitting[0] if fitting else min(tried, key=tried.get) if tried else OFFLOADS[-1]
    need = tried.get(choice)
    fits = f"predicted {gib(need).strip()}" if need is not None else "nothing fits"
    print(f"--offload auto: {choice} ({fits} per device"
          + (f", budget {gib(budget).strip()})" if budget else ", no device budget)"),
          flush=True)
    return config.replace(offload=choice)


def plan_breakdown(config, plan) -> Breakdown:
    data = config.data
    return predict(plan, data.batch_size // config.memory.grad_accum, data.seq_len)


def check_fits(config, plan) -> None:
    """Refuse, in one line, a configuration whose plan exceeds the device's memory."""

    budget = device_budget(config)
    need = plan_breakdown(config, plan).total
    if budget and need > budget:
        raise ConfigError(
            f"the plan needs {need / 2**30:.2f} GiB per device but a device has "
            f"{budget / 2**30:.2f} GiB; try {suggest(config, budget)}")


def dry_run(config) -> None:
    """`--dry-run`: compile the step ahead of time, print the plan beside the compiler's
    numbers and the step's communication (`jdist.tools.comm`), check it fits, and return without
    allocating anything."""
    from jdist.train.report import compute_line, layout_table

    config = resolve_offload(config)
    _, plan, _ = plan_for(config)
    print(layout_table(plan), flush=True)
    print(compute_line(plan, config), flush=True)
    if plan.pipeline is not None:
        from jdist.parallel.pipeline import stashes
        from jdist.plan.cost import pipeline_bubble

        schedule = plan.pipeline.table(plan.mesh.shape["stage"], stash=stashes(plan.compute.remat))
        print(f"{schedule.summary()}; time-weighted bubble "
              f"{pipeline_bubble(schedule, plan.compute.remat):.3f}", flush=True)
    compiled, measured = compile_and_measure(plan, config.data.batch_size, config.data.seq_len)
    print(table(plan_breakdown(config, plan), measured), flush=True)
    if config.devices.target:
        hosts = config.devices.hosts
        print(f"compiled for {plan.mesh.devices.size} x {config.devices.target} on {hosts} "
              f"host{'s' if hosts > 1 else ''} by the GPU compiler: peak "
              f"{gib(peak(compiled)).strip()} per device", flush=True)
        print(gpu_report.table(gpu_report.step_report(compiled, plan, config.data.batch_size,
                                                      config.data.seq_len)), flush=True)
    else:
        print(comm_table(step_report(compiled, config.parallel.mesh, plan.mesh)), flush=True)
    check_fits(config, plan)
    budget = device_budget(config)
    if config.devices.target and budget and peak(compiled) > budget:
        raise ConfigError(f"the GPU-compiled step needs {peak(compiled) / 2**30:.2f} GiB per "
                          f"device but {config.devices.target} lets a process allocate "
                          f"{budget / 2**30:.2f} GiB; try {suggest(config, budget)}")
    print("dry run: the plan fits; nothing was allocated", flush=True)


