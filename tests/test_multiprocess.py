"""Two real processes (jax.distributed on localhost, gloo) x 4 CPU devices train exactly like
one process with 8 devices: the same global batches, the same losses. Pipelined, the stages
land on different processes (`stage` is the slowest axis after `data`, so it spans DCN) and
activations cross processes as collective-permutes. Both runs compare the processes' host
step times every step: the pipelined one slows process 1 (`--inject-straggler`), which must
be reported within 3 windows; the data-parallel one is not slowed and must report nothing."""

import json
import socket
import subprocess
import sys

import pytest

from jdist.config import parse_args
from jdist.train.loop import train

COMMON = ["--model", "tiny", "--steps", "4", "--batch-size", "16", "--seq-len", "32",
          "--eval-every", "4"]
STRAGGLERS = ["--straggler-every", "1", "--straggler-windows", "2"]
DATA_PARALLEL = (["--mesh", "dp=2,fsdp=4", *STRAGGLERS], "mesh: data=2 fsdp=4 (8 devices, cpu)")
PIPELINED = (["--mesh", "pp=2,fsdp=4", "--n-layers", "4", "--pp-schedule", "interleaved",
              "--pp-virtual-stages", "2", "--microbatches", "2", *STRAGGLERS,
              "--inject-straggler", "1:0.4"],
             "mesh: stage=2 fsdp=4 (8 devices, cpu)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


@pytest.mark.parametrize("mesh_args, banner", [DATA_PARALLEL, PIPELINED],
                         ids=["dp-fsdp", "pp-interleaved"])
def test_two_processes_match_one(tmp_path, mesh_args, banner):
    port = free_port()
    args = [*COMMON, *mesh_args]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jdist.train", *args, "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i), "--run-dir", str(tmp_path / f"p{i}"),
         # Each process has its own run dir here (to show process 1 writes nothing); a
         # checkpoint's shards need one directory all processes share.
         "--no-final-checkpoint"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert banner in outputs[0], outputs[0]
    assert "step 4/4" not in outputs[1]  # only process 0 reports
    assert not (tmp_path / "p1").exists()  # ... and writes
    reported = [r["step"] for r in records(tmp_path / "p0") if r.get("stragglers") == [1]]
    if "--inject-straggler" in args:  # windows of 1 step, 2 in a row: step 2, at most 3
        assert reported and reported[0] <= 3, outputs[0]
        assert "straggler: process 1 on host" in outputs[0]
    else:
        assert "straggler" not in outputs[0] and not reported, outputs[0]
    # The reference: one process with all 8 devices, this one (no interpreter, jax and
    # jdist to start again: 3 s of CPU), as tests/test_elastic.py's and test_slurm.py's.
    train(parse_args([*args, "--run-dir", str(tmp_path / "single")]))
    multi, ref = losses(tmp_path / "p0"), losses(tmp_path / "single")
    assert len(multi) == 4
    for a, b in zip(multi, ref):
        assert abs(a - b) <= 1e-5 * abs(b)
