"""What the hardware says about a run: each device's memory in use and at peak (as its
backend reports it), and the share of device time a profiled step spent in collectives
(read from the `--profile-steps` trace by `jdist.tools.profile`)."""

from __future__ import annotations

import statistics

import jax

NA = "n/a"  # the console's word for a figure the backend does not report


def device_memory() -> dict:
    """This process's devices' bytes in use now and at peak: the busiest device's
    (`memory_in_use_bytes`, `memory_peak_bytes`) and each device's, by device id. `None`
    where the backend reports nothing (jax 0.10.2's CPU `memory_stats()` is `None`): JSON
    null, not a made-up 0."""
    stats = {str(d.id): d.memory_stats() for d in jax.local_devices()}
    if not all(stats.values()):
        return dict.fromkeys(("memory_in_use_bytes", "memory_peak_bytes",
                              "memory_in_use_bytes_by_device", "memory_peak_bytes_by_device"))
    now = {d: s.get("bytes_in_use", 0) for d, s in stats.items()}
    peak = {d: s.get("peak_bytes_in_use", 0) for d, s in stats.items()}
    return {"memory_in_use_bytes": max(now.values()), "memory_peak_bytes": max(peak.values()),
            "memory_in_use_bytes_by_device": now, "memory_peak_bytes_by_device": peak}


def memory_text(record: dict) -> str:
    """The progress line's memory: the busiest device's in use / peak, or n/a."""
    now, peak = record.get("memory_in_use_bytes"), record.get("memory_peak_bytes")
    if now is None or peak is None:
        return f"mem {NA}"
    return f"mem {now / 2**30:.2f}/{peak / 2**30:.2f} GiB"


def profile_line(records: list[dict], where: str) -> str | None:
    """One line on the profiled steps' device time (means over steps and devices), or None
    when the trace gave no fractions."""
    read = [r for r in records if "comm_fraction" in r]
    if not read:
        return None
    mean = lambda key: statistics.fmean(r[key] for r in read)
    steps = read[0]["step"], read[-1]["step"]
    span = f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}"
    return (f"profile of {span}: collectives {mean('comm_fraction'):.1%} of device time "
            f"(+{mean('hidden_comm_fraction'):.1%} hidden under compute), compute "
            f"{mean('compute_fraction'):.1%}, idle {mean('idle_fraction'):.1%}; trace in {where}")
