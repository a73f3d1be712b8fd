"""A training plan as a Kubernetes JobSet (`python -m jdist.plan --emit jobset`): one
replicated job of one indexed Job, a pod per host, each driving its host's GPUs. The pods
find their coordinator by DNS under the JobSet's headless service and their index in
JOB_COMPLETION_INDEX (`jdist.runtime.schedulers.indexed_job`); a failed pod restarts the
whole set, which resumes from the newest good checkpoint on the shared run volume."""

from __future__ import annotations

import re

from jdist.runtime.schedulers import JOBSET_PORT

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"
RUNS_MOUNT = "/runs"
MAX_RESTARTS = 10
GRACE_S = 120  # SIGTERM to SIGKILL on eviction or restart: time to save a checkpoint
LABEL = "jobset.sigs.k8s.io/"


def k8s_name(text: str, limit: int = 40) -> str:
    """A DNS label from `text` (lower case, [a-z0-9-], starting with a letter), short enough
    that a pod's hostname, NAME-workers-INDEX-0, stays within 63 characters."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return ("jdist-" + name)[:limit].rstrip("-")


def from_label(env_name: str, label: str) -> dict:
    return {"name": env_name,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL}{label}']"}}}


def manifest(train_args: list[str], *, name: str, hosts: int, gpus_per_host: int,
             checkpoint_every: int, image: str = "jdist:latest") -> dict:
    run_dir = f"{RUNS_MOUNT}/{name}"
    container = {
        "name": "train",
        "image": image,
        "command": ["python", "-m", "jdist.train", *train_args, "--run-dir", run_dir,
                    "--resume", "auto", "--checkpoint-every", str(checkpoint_every)],
        "env": [from_label("JOBSET_NAME", "jobset-name"),
                from_label("REPLICATED_JOB_NAME", "replicatedjob-name"),
                {"name": "JDIST_NUM_PROCESSES", "value": str(hosts)}],
        "ports": [{"containerPort": JOBSET_PORT, "name": "coordinator"}],
        "volumeMounts": [{"name": "runs", "mountPath": RUNS_MOUNT}],
    }
    if gpus_per_host:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_host}}
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": GRACE_S,
           "containers": [container],
           # Every pod writes its shards of a checkpoint into one directory: the claim must
           # be ReadWriteMany (a shared file system).
           "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": "jdist-runs"}}]}
    job = {"completionMode": "Indexed", "completions": hosts, "parallelism": hosts,
           "backoffLimit": 0, "template": {"spec": pod}}
    return {
        "apiVersion": API_VERSION, "kind": "JobSet", "metadata": {"name": name},
        "spec": {
            # Pods reach each other as NAME-workers-INDEX-0.NAME (the headless service the
            # JobSet makes); published before they are ready, since pod 0 is the
            # coordinator the others wait for.
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": MAX_RESTARTS},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                                "template": {"spec": job}}],
        },
    }


def render(doc: dict, summary: str) -> str:
    import yaml  # PyYAML: installed with orbax-checkpoint and flax

    head = [f"# {summary}",
            "# Written by python -m jdist.plan --emit jobset. Before kubectl apply -f: set the",
            "# image (one with jdist installed) and create the PersistentVolumeClaim",
            "# jdist-runs (ReadWriteMany) that holds the run directory and its checkpoints."]
    return "\n".join(head) + "\n" + yaml.safe_dump(doc, sort_keys=False)
