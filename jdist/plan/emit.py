"""`python -m jdist.plan --emit slurm|jobset [--out FILE]`: the chosen layout as a
multi-host launch, an sbatch script (`jdist.launch.slurm`) or a JobSet manifest
(`jdist.launch.jobset`), written whole or not at all."""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

from jdist.errors import ConfigError, require
from jdist.files import write_atomically
from jdist.launch import jobset, slurm

SUFFIX = {"slurm": ".sbatch", "jobset": ".yaml"}
CHECKPOINT_MINUTES = 30  # of predicted steps between checkpoints: what a failure can cost


def job_name(model: str) -> str:
    """`jdist-MODEL` as a DNS label (valid for Slurm too); a model directory by its name."""
    path = Path(model)
    if model.endswith("config.json"):
        path = path.parent
    return jobset.k8s_name(path.resolve().name if os.path.exists(model) else model)


def out_path(kind: str, out: str, model: str) -> Path:
    """--out, or NAME.sbatch / NAME.yaml here. Probed before the search (a bad path is
    refused at once, not after it): the directory must exist and take a new file."""
    path = Path(out or job_name(model) + SUFFIX[kind])
    require(not path.is_dir(), f"--out {path} is a directory; name a file in it, e.g. "
            f"--out {path / (job_name(model) + SUFFIX[kind])}")
    parent = path.parent
    require(parent.is_dir(), f"--out {path}: directory {parent} does not exist; create it or "
            "name a file in an existing directory")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}."):
            pass
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot write in {parent} ({e.strerror}); name a "
                          "file in a writable directory") from None
    return path


def checkpoint_every(step_s: float) -> int:
    """Steps in CHECKPOINT_MINUTES of the plan's predicted step time."""
    return max(1, round(CHECKPOINT_MINUTES * 60 / step_s))


def render(kind: str, command: str, *, model: str, hosts: int, gpus_per_host: int,
           step_s: float, summary: str) -> str:
    train_args = shlex.split(command)[3:]  # after `python -m jdist.train`
    name, every = job_name(model), checkpoint_every(step_s)
    if kind == "slurm":
        return slurm.script(train_args, job_name=name, hosts=hosts, checkpoint_every=every,
                            gpus_per_host=gpus_per_host, summary=summary)
    return jobset.render(jobset.manifest(train_args, name=name, hosts=hosts,
                                         gpus_per_host=gpus_per_host, checkpoint_every=every),
                         summary)


def write(path: Path, text: str) -> None:
    """A file that exists is the whole script, old or new."""
    try:
        write_atomically(path, text, 0o755 if text.startswith("#!") else 0o644)
    except OSError as e:
        raise ConfigError(f"--out {path}: {e.strerror}; name a file in a writable "
                          "directory") from None


def how_to_run(kind: str, path: Path) -> str:
    if kind == "slurm":
        return f"wrote {path}: sbatch {path} [--steps N --data FILE ...]"
    return f"wrote {path}: set its image and claim, then kubectl apply -f {path}"
