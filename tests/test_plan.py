"""The parallelism planner's machinery (`jdist.plan`): layouts and their flags, the cost
model's terms, the CLI's table/JSON and its refusals. Timings are checked by
`benchmarks/planner.py`, not here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jdist import axes as ax
from jdist.errors import ConfigError
from jdist.parallel.pipeline import PipelineConfig
from jdist.plan import cost, layouts
from jdist.plan.__main__ import main as plan_main
from jdist.plan.profiles import load_profile
from jdist.train.config import parse_args
from models import get_preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def uncalibrated(monkeypatch, tmp_path):
    """cpu-sim with the shipped defaults, whatever this machine has calibrated."""
    monkeypatch.setenv("JDIST_CALIBRATION", str(tmp_path / "none.toml"))


def test_factorizations_cover_every_mesh():
    shapes = list(layouts.meshes(8, moe=False, fixed={}, max_tensor=8))
    assert len(shapes) == 35  # ordered factorizations of 2^3 over 5 axes: C(3+4, 4)
    assert all(s[ax.EXPERT] == 1 for s in shapes)
    fixed = list(layouts.meshes(8, moe=False, fixed={ax.TENSOR: 2}, max_tensor=8))
    assert fixed and all(s[ax.TENSOR] == 2 for s in fixed)
    assert not [s for s in layouts.meshes(64, False, {}, max_tensor=8) if s[ax.TENSOR] > 8]


def test_layout_flags_are_the_trainers():
    """A layout's command line parses back into the TrainConfig the planner planned."""
    sizes = tuple((a, {ax.STAGE: 2, ax.FSDP: 2, ax.TENSOR: 2}.get(a, 1)) for a in ax.MESH_AXES)
    layout = layouts.Layout(sizes, zero=0, remat="full", sequence_parallel=True,
                            pp_schedule="interleaved", microbatches=4, virtual=2,
                            attention="flash", offload=True)
    base = parse_args(["--model", "small", "--batch-size", "16", "--seq-len", "128"])
    planned = layout.to_config(base)
    parsed = parse_args(["--model", "small", "--batch-size", "16", "--seq-len", "128",
                         *layout.flags(), "--cpu-devices", "8"])
    assert parsed == planned


def test_executed_flops_count_recomputation():
    model = get_preset("small")
    f = lambda **kw: cost.executed_flops(model, 1024, 1000.0, **{
        "attention": "flash", "remat": "none", "pipelined": False, "loss": "full",
        "stages": 1, **kw})
    assert f(remat="full") > f(remat="selective") > f()
    assert f(pipelined=True, stages=2) > f() / 2  # a stage does half the blocks, recomputed
    assert f(attention="xla") > f()               # dense attention computes masked scores
    assert f(loss="chunked") > f()                # the chunked loss recomputes its logits


def test_pipeline_bubble_weighs_backward_ticks():
    """With backward ticks 3x a forward, 1F1B on 2 stages x 2 micro-batches idles more than
    the tick count says, and more micro-batches shrink it."""
    small = cost.pipeline_bubble(PipelineConfig("1f1b", 2).table(2), "none")
    large = cost.pipeline_bubble(PipelineConfig("1f1b", 8).table(2), "none")
    assert small > PipelineConfig("1f1b", 2).table(2).bubble_fraction() * 0.99
    assert 0 < large < small < 0.5


def test_overlap_hides_replica_collectives_only():
    from jdist.comm import Row
    assert cost.hideable(Row("all-gather", (ax.FSDP,)))
    assert cost.hideable(Row("reduce-scatter", (ax.DATA, ax.FSDP)))
    assert cost.hideable(Row("collective-permute", (ax.SEQUENCE,)))
    assert not cost.hideable(Row("all-reduce", (ax.TENSOR,)))
    assert not cost.hideable(Row("collective-permute", (ax.STAGE,)))


def test_plan_small_on_cpu_sim(capsys):
    assert plan_main(["--model", "small", "--devices", "8", "--accelerator", "cpu-sim",
                      "--batch-size", "16", "--seq-len", "128", "--json", "--top", "50"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["layouts"]
    assert len(rows) == 50
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    meshes = {r["layout"].split()[0] for r in rows}
    assert len(meshes) > 10
    assert all(r["bottleneck"] for r in rows)
    assert out["command"].startswith("python -m jdist.train --model small --batch-size 16")
    # Every row's flags are a valid training command on 8 devices.
    for r in rows[:5]:
        parse_args(["--model", "small", *r["flags"]])


def test_fixed_axes_are_respected(capsys):
    assert plan_main(["--model", "small", "--devices", "8", "--accelerator", "cpu-sim",
                      "--batch-size", "16", "--seq-len", "128", "--fix", "tp=2,pp=2",
                      "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all("tp=2" in r["layout"] and "pp=2" in r["layout"] for r in out["layouts"])


@pytest.mark.parametrize("argv, words", [
    (["--accelerator", "tpu-v9"], ["unknown accelerator profile 'tpu-v9'", "h100-80gb"]),
    (["--accelerator", "a100-80gb", "--model", "llama3.1-8b", "--devices", "1",
      "--batch-size", "8", "--seq-len", "8192"],
     ["no layout of llama3.1-8b on 1 a100-80gb devices fits", "--devices", "QLoRA"]),
    (["--accelerator", "h100-80gb", "--devices", "12", "--hosts", "5"], ["do not split"]),
])
def test_bad_input_is_one_line(argv, words, capsys):
    base = {"--model": "small", "--devices": "8", "--batch-size": "16", "--seq-len": "128"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1]
    assert plan_main([x for kv in base.items() for x in kv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("jdist: error: ")
    for w in words:
        assert w in err, err


def test_unknown_profile_raises_config_error():
    with pytest.raises(ConfigError):
        load_profile("h100")


def test_70b_on_64_h100s():
    """The acceptance command: a ranked table, every layout fitting 80 GB by the planner's
    own memory model, and the best one passing the trainer's pre-compile checks."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "plan_70b.py")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["plan"]["layouts"]
    assert len(rows) == 20 and out["checks"] == "passed"
    assert all(r["memory"]["total"] <= 80e9 for r in rows)
    assert rows[0]["step_s"] <= rows[-1]["step_s"]
