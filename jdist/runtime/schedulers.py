"""What the scheduler that started this process says about its process group, read from an
environment mapping (pure functions: the tests hand them the variables a scheduler sets).

Slurm: `jax.distributed` detects a job step itself (SLURM_JOB_ID, SLURM_STEP_NODELIST,
SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID: coordinator the step's first node, port from the
job id); what it gets wrong is which GPUs a task drives, so `slurm_local_devices` says.

Kubernetes: a pod of an indexed Job has JOB_COMPLETION_INDEX, its process index. jax's own
detection asks the Kubernetes API (the `kubernetes` package and a service account allowed
to list pods); `indexed_job` needs neither. In a JobSet (`python -m jdist.plan --emit
jobset`) the coordinator is pod 0 of job 0 under the JobSet's headless service:
`JOBSET-RJOB-0-0.JOBSET:PORT`, from JOBSET_NAME and REPLICATED_JOB_NAME (the manifest maps
the pod's labels to them); JDIST_NUM_PROCESSES is the Job's completions (a pod cannot read
its Job's spec without the API)."""

from __future__ import annotations

from collections.abc import Mapping

from jdist.errors import ConfigError, require

# The port jax's own Kubernetes detection uses; JAX_COORDINATOR_PORT overrides both.
JOBSET_PORT = 55527
SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                   "SLURM_LOCALID")


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer; "
                          "fix or unset it") from None


def slurm_tasks(env: Mapping[str, str]) -> int:
    """How many processes a Slurm job step has (0: not in a multi-task allocation). A
    multi-task allocation seen from outside a step (the batch script itself) is refused:
    its processes would each train alone."""
    n = env_int(env, "SLURM_NTASKS", 1)
    if n <= 1:
        return 0
    missing = [v for v in SLURM_STEP_VARS if v not in env]
    require(not missing, f"this process is in a Slurm allocation of {n} tasks but not in a "
            f"job step ({', '.join(missing)} unset): start it with srun, e.g. "
            "srun python -m jdist.train ...")
    return n


def slurm_local_devices(env: Mapping[str, str]) -> list[int] | None:
    """The GPUs a Slurm task drives: all it was given (CUDA_VISIBLE_DEVICES, set by
    --gpus-per-task or --gpus-per-node), as indices into that list. Left to jax (None) it
    would take one GPU, the one numbered SLURM_LOCALID, which is wrong for one task per node
    (7 of 8 GPUs idle) and for Slurm's per-task binding (every task sees its GPU as 0)."""
    ids = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return list(range(len(ids))) if ids else None


def indexed_job(env: Mapping[str, str]) -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) for a pod of an indexed Job, else None."""
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    index = env_int(env, "JOB_COMPLETION_INDEX", 0)
    n = env_int(env, "JDIST_NUM_PROCESSES", 0)
    require(n >= 1, f"this pod is index {index} of an indexed Job, but JDIST_NUM_PROCESSES "
            "(the Job's completions) is unset; set it in the pod's env (python -m jdist.plan "
            "--emit jobset writes it)")
    require(0 <= index < n, f"JOB_COMPLETION_INDEX={index} is not below JDIST_NUM_PROCESSES="
            f"{n}; make the Job's completions equal JDIST_NUM_PROCESSES")
    coordinator = env.get("JDIST_COORDINATOR", "")
    if not coordinator:
        jobset, rjob = env.get("JOBSET_NAME", ""), env.get("REPLICATED_JOB_NAME", "")
        require(bool(jobset and rjob), f"this pod is index {index} of an indexed Job outside "
                "a JobSet (no JOBSET_NAME, REPLICATED_JOB_NAME): set JDIST_COORDINATOR to "
                "HOST:PORT of pod 0 (its name under the Job's headless service)")
        port = env_int(env, "JAX_COORDINATOR_PORT", JOBSET_PORT)
        coordinator = f"{jobset}-{rjob}-0-0.{jobset}:{port}"
    return coordinator, n, index
