"""The devices a run has: the simulated CPU platform's size, multi-process start-up
(`jax.distributed` from explicit flags, environment variables, an indexed Job's pod or a
Slurm job step: `jdist.runtime.schedulers`), which process speaks, and which devices a mesh
is built on (jax's, or a deviceless GPU target's, `jdist.runtime.target`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from jdist.errors import require
from jdist.runtime import schedulers
from jdist.runtime.schedulers import env_int

ENV_COORDINATOR = "JDIST_COORDINATOR"      # host:port of process 0
ENV_NUM_PROCESSES = "JDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JDIST_PROCESS_ID"


def process_settings(coordinator: str = "", num_processes: int = 0, process_id: int = -1,
                     env: Mapping[str, str] = os.environ) -> tuple[str, int, int]:
    """(coordinator, num_processes, process_id): flags first, then JDIST_* env, then an
    indexed Job's pod (a JobSet), then a Slurm job step ("slurm": jax detects the rest)."""
    coordinator = coordinator or env.get(ENV_COORDINATOR, "")
    num_processes = num_processes or env_int(env, ENV_NUM_PROCESSES, 0)
    if process_id < 0:
        process_id = env_int(env, ENV_PROCESS_ID, -1)
    if process_id < 0 and (pod := schedulers.indexed_job(env)):
        return pod if not coordinator else (coordinator, pod[1], pod[2])
    if not coordinator and (tasks := schedulers.slurm_tasks(env)):
        return "slurm", tasks, env_int(env, "SLURM_PROCID", 0)
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
    if coordinator == "slurm":  # jax reads the job step's variables itself
        jax.distributed.initialize(
            local_device_ids=schedulers.slurm_local_devices(os.environ))
    else:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id)


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


def configure_devices(n_local: int) -> None:
    """Simulate `n_local` CPU devices. Only the CPU platform reads this, so it is harmless
    on accelerators (whose devices are counted as they are, see `check_process_split`); it
    must happen before JAX initialises its backends."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n_local)
    except RuntimeError:  # backends already up (e.g. called from a test): keep what exists
        pass


def check_process_split(cpu_devices: int, n_proc: int) -> None:
    """Every process must hold the same number of devices: on CPU, of the `cpu_devices`
    simulated in all (each process was given its share by `configure_devices`); on
    accelerators, of the devices that exist. Call once the process group is joined."""
    import jax

    n = cpu_devices if jax.default_backend() == "cpu" else jax.device_count()
    require(n % n_proc == 0, f"{n} devices cannot be split evenly over {n_proc} processes; "
            "change the mesh or the process count")


def mesh_devices(spec, cpu_fill: int, target: str = "", hosts: int = 1) -> list:
    """The devices a mesh runs on: a deviceless GPU `target`'s (`jdist.runtime.target`; a -1 axis
    fills its hosts' 8 devices each), else jax's. Simulated CPU devices beyond what the mesh
    needs are left idle."""
    if target:
        from jdist.runtime import target as gpu_target

        require(hosts >= 1, f"--hosts {hosts} must be at least 1")
        return list(gpu_target.devices(target, spec.n_devices(8 * hosts), hosts))
    import jax

    devices = jax.devices()
    if devices[0].platform == "cpu" and jax.process_count() == 1:
        return devices[: min(len(devices), spec.n_devices(cpu_fill))]
    return devices
