"""Which process group a scheduler's environment puts a process in (`process_settings` over
the variables Slurm and an indexed Job's pods set), and what is refused in one line."""

import pytest

from jdist.errors import ConfigError
from jdist.runtime.distributed import process_settings
from jdist.runtime.schedulers import JOBSET_PORT, slurm_local_devices

# What `srun` gives task 1 of a 2-task step (job 42 on node vm).
SLURM_STEP = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "vm", "SLURM_NTASKS": "2",
              "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_JOB_NAME": "jdist-tiny"}
# What Kubernetes and the manifest's env give pod 3 of an 8-pod indexed Job in a JobSet.
JOBSET_POD = {"JOB_COMPLETION_INDEX": "3", "JOBSET_NAME": "jdist-llama3-1-70b",
              "REPLICATED_JOB_NAME": "workers", "JDIST_NUM_PROCESSES": "8",
              "HOSTNAME": "jdist-llama3-1-70b-workers-0-3"}


def test_slurm_step_is_left_to_jax_detection():
    assert process_settings(env=SLURM_STEP) == ("slurm", 2, 1)
    assert process_settings(env={**SLURM_STEP, "SLURM_NTASKS": "1"}) == ("", 1, 0)
    # Explicit settings win over the allocation's.
    assert process_settings("h:1", 4, 2, env=SLURM_STEP) == ("h:1", 4, 2)


def test_slurm_batch_shell_is_refused():
    """The batch script itself (no job step): each process would train alone."""
    shell = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_NODELIST"}
    with pytest.raises(ConfigError, match="not in a job step.*SLURM_STEP_NODELIST.*srun"):
        process_settings(env=shell)


def test_slurm_task_drives_every_gpu_it_was_given():
    assert slurm_local_devices({**SLURM_STEP, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == \
        [0, 1, 2, 3]
    assert slurm_local_devices(SLURM_STEP) is None  # CPU: jax's default, harmless


def test_jobset_pod_finds_its_coordinator_by_dns():
    assert process_settings(env=JOBSET_POD) == (
        f"jdist-llama3-1-70b-workers-0-0.jdist-llama3-1-70b:{JOBSET_PORT}", 8, 3)
    assert process_settings(env={**JOBSET_POD, "JAX_COORDINATOR_PORT": "1234"})[0] == \
        "jdist-llama3-1-70b-workers-0-0.jdist-llama3-1-70b:1234"
    # A plain indexed Job names its coordinator itself; JDIST_PROCESS_ID or a flag wins.
    plain = {"JOB_COMPLETION_INDEX": "1", "JDIST_NUM_PROCESSES": "2",
             "JDIST_COORDINATOR": "job-0.svc:9000"}
    assert process_settings(env=plain) == ("job-0.svc:9000", 2, 1)
    assert process_settings(env={**plain, "JDIST_PROCESS_ID": "0"}) == ("job-0.svc:9000", 2, 0)


@pytest.mark.parametrize("change, words", [
    ({"JDIST_NUM_PROCESSES": None}, "JDIST_NUM_PROCESSES (the Job's completions) is unset"),
    ({"JOB_COMPLETION_INDEX": "8"}, "JOB_COMPLETION_INDEX=8 is not below"),
    ({"JOBSET_NAME": None}, "outside a JobSet"),
    ({"JOB_COMPLETION_INDEX": "x"}, "JOB_COMPLETION_INDEX='x' is not an integer"),
])
def test_bad_pod_environment_is_one_line(change, words):
    env = {k: v for k, v in {**JOBSET_POD, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        process_settings(env=env)
    assert "\n" not in str(e.value)
