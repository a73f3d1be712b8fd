"""A training plan as a Slurm batch script (`python -m jdist.plan --emit slurm`): one task
per host, each driving its host's GPUs, joined by `jax.distributed`'s own Slurm detection
(`jdist.runtime.schedulers`); requeued on preemption, resuming from the run directory's
newest good checkpoint."""

from __future__ import annotations

import shlex

from jdist.errors import EXIT_PREEMPTED

SIGNAL_LEAD_S = 120  # SIGTERM this long before the time limit: time to save


def directives(job_name: str, hosts: int, gpus_per_host: int) -> list[str]:
    lines = [f"--job-name={job_name}", f"--nodes={hosts}", "--ntasks-per-node=1"]
    if gpus_per_host:
        lines += [f"--gpus-per-task={gpus_per_host}", "--exclusive"]
    # --requeue: preemption and `scontrol requeue` put the job back in the queue under the
    # same id, so its run directory (named by the id) is found again. TERM goes to the
    # tasks, not the batch shell (no B:), so every process saves.
    lines += ["--requeue", f"--signal=TERM@{SIGNAL_LEAD_S}", "--open-mode=append",
              "--output=%x-%j.out"]
    return [f"#SBATCH {d}" for d in lines]


def script(train_args: list[str], *, job_name: str, hosts: int, gpus_per_host: int,
           checkpoint_every: int, summary: str) -> str:
    """The sbatch script. `train_args`: `python -m jdist.train`'s flags for the layout;
    arguments given to sbatch after the script's name are appended to them (and win)."""
    train = " ".join(shlex.quote(a) for a in ["python", "-m", "jdist.train", *train_args])
    return "\n".join([
        "#!/bin/bash",
        f"# {summary}",
        "# Written by python -m jdist.plan --emit slurm. Submit from a directory every node",
        "# sees: sbatch THIS_FILE [more jdist.train flags, e.g. --steps 10000 --data FILE].",
        "# JDIST_RUN_DIR overrides the run directory (default runs/NAME-JOBID).",
        *directives(job_name, hosts, gpus_per_host),
        "",
        'run_dir=${JDIST_RUN_DIR:-runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}',
        "# srun starts one process per task; jax.distributed reads the job step's",
        "# SLURM_* variables (coordinator: the first node). --resume auto continues from the",
        "# newest good checkpoint in the run directory, so a requeued job picks up there.",
        f'srun {train} --run-dir "$run_dir" --resume auto \\',
        f'    --checkpoint-every {checkpoint_every} "$@"',
        "status=$?",
        f"# {EXIT_PREEMPTED}: stopped by SIGTERM (the time limit's --signal) after saving a",
        "# checkpoint of the current step: back in the queue, to resume.",
        f'if [ "$status" -eq {EXIT_PREEMPTED} ]; then',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
        "",
    ])
