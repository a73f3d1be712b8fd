"""`python -m jdist.plan --emit slurm|jobset`: the plan as a multi-host launch. The JobSet
manifest parses as YAML with the fields JobSet and its indexed Job require, and the env it
gives a pod, resolved as Kubernetes would, puts the pod in the right process group. (The
sbatch script runs for real in tests/test_slurm.py.) Bad input: one line, exit 2, nothing
written."""

import json
import subprocess

import pytest
import yaml

from jdist.config import parse_args
from jdist.launch import jobset
from jdist.plan import emit
from jdist.plan.__main__ import main as plan_main
from jdist.runtime.distributed import process_settings

PLAN = ["--model", "tiny", "--devices", "8", "--hosts", "2", "--accelerator", "cpu-sim",
        "--batch-size", "8", "--seq-len", "32", "--fix", "dp=2,fsdp=4"]
COMMAND = "python -m jdist.train --model tiny --batch-size 8 --seq-len 32 --mesh dp=8"


def pod_env(container: dict, labels: dict, index: int) -> dict:
    """The variables a pod of the Job gets: the container's values, its label references
    resolved, and the completion index Kubernetes adds to every pod of an indexed Job."""
    env = {"JOB_COMPLETION_INDEX": str(index)}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = labels[path.split("['")[1].rstrip("']")]
    return env


def test_jobset_manifest_has_what_jobset_requires(tmp_path, capsys):
    out = tmp_path / "train.yaml"
    assert plan_main([*PLAN, "--emit", "jobset", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["emitted"] == str(out)
    doc = yaml.safe_load(out.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    name = doc["metadata"]["name"]
    assert name == "jdist-tiny" and doc["spec"]["network"]["enableDNSHostnames"] is True
    [rjob] = doc["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 1
    job = rjob["template"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")  # a Job's pods may not be Always
    [container] = pod["containers"]
    assert container["image"] and container["command"][:3] == ["python", "-m", "jdist.train"]
    parse_args(container["command"][3:])  # the trainer's own flags
    assert "resources" not in container  # cpu-sim: no GPUs to ask for
    labels = {"jobset.sigs.k8s.io/jobset-name": name,
              "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"]}
    # JobSet names pod I of job 0 NAME-RJOB-0-I under the subdomain NAME.
    coordinator = f"{name}-{rjob['name']}-0-0.{name}:{jobset.JOBSET_PORT}"
    for i in range(2):
        assert process_settings(env=pod_env(container, labels, i)) == (coordinator, 2, i)


def test_gpu_hosts_ask_for_their_gpus():
    kw = dict(model="llama3.1-70b", hosts=8, gpus_per_host=8, step_s=60.0, summary="s")
    doc = yaml.safe_load(emit.render("jobset", COMMAND, **kw))
    [rjob] = doc["spec"]["replicatedJobs"]
    container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert rjob["template"]["spec"]["completions"] == 8
    script = emit.render("slurm", COMMAND, **kw)
    for line in ["#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-task=8", "#SBATCH --requeue", "#SBATCH --signal=TERM@",
                 "--checkpoint-every 30 "]:  # 30 minutes of 60 s steps
        assert line in script, line
    assert "srun python -m jdist.train --model tiny" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("argv, words", [
    (["--emit", "pbs"], "argument --emit: invalid choice: 'pbs'"),
    (["--emit", "slurm", "--out", "/proc/jdist/x.sbatch"], "directory /proc/jdist does not"),
    (["--emit", "slurm", "--out", "/proc/x.sbatch"], "cannot write in /proc"),
    (["--emit", "jobset", "--out", "FILE/x.yaml"], "directory FILE does not exist"),
    (["--emit", "jobset", "--out", "."], "is a directory"),
    (["--out", "x.sbatch"], "add --emit"),
    (["--emit", "slurm", "--hosts", "3"], "--devices 8 do not split evenly over --hosts 3"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file, not a directory")
    args = [*PLAN[:4], *PLAN[6:], "--hosts", "2", *argv]  # --hosts: the last one counts
    assert plan_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("jdist: error: ") and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]
