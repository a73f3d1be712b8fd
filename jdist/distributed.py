"""Multi-process start-up: `jax.distributed` from explicit flags, environment variables, or
a Slurm allocation; and which process speaks."""

from __future__ import annotations

import os

from jdist.errors import ConfigError, require

ENV_COORDINATOR = "JDIST_COORDINATOR"      # host:port of process 0
ENV_NUM_PROCESSES = "JDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JDIST_PROCESS_ID"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer; "
                          "fix or unset it") from None


def process_settings(coordinator: str = "", num_processes: int = 0,
                     process_id: int = -1) -> tuple[str, int, int]:
    """(coordinator, num_processes, process_id): flags first, then JDIST_* env, then Slurm."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR, "")
    num_processes = num_processes or _env_int(ENV_NUM_PROCESSES, 0)
    if process_id < 0:
        process_id = _env_int(ENV_PROCESS_ID, -1)
    if not coordinator and _env_int("SLURM_NTASKS", 1) > 1:
        return "slurm", _env_int("SLURM_NTASKS", 1), _env_int("SLURM_PROCID", 0)
    if not coordinator:
        return "", 1, 0
    require(num_processes >= 1 and 0 <= process_id < num_processes,
            f"multi-process run with coordinator {coordinator!r} needs --num-processes N and "
            f"--process-id in [0, N); got {num_processes} and {process_id}")
    return coordinator, num_processes, process_id


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the process group (no-op for a single process). Call before any device use."""
    if num_processes <= 1:
        return
    import jax

    try:  # CPU collectives across processes need gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass
    if coordinator == "slurm":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id)


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0
