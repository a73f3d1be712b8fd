"""The parallelism planner's machinery (`jdist.plan`): layouts and their flags, the cost
model's terms, the CLI's table/JSON and its refusals. Timings are checked by
`benchmarks/planner.py`, not here."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jdist.config import parse_args
from jdist.errors import ConfigError
from jdist.models import get_preset
from jdist.parallel.moe import expert_factor
from jdist.parallel.pipeline import PipelineConfig
from jdist.plan import cost, layouts
from jdist.plan.__main__ import main as plan_main
from jdist.plan.profiles import load_profile
from jdist.spmd import axes as ax

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
                            attention="flash", offload=True, moe_overlap="off")
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
    # A stage does half the blocks: reading its stash, no more; under full remat its
    # backward also recomputes the chunk first.
    assert f(pipelined=True, stages=2) == pytest.approx(f(stages=2))
    assert f(pipelined=True, stages=2, remat="full") > f(stages=2, remat="full")
    assert f(attention="xla") > f()               # dense attention computes masked scores
    assert f(loss="chunked") > f()                # the chunked loss recomputes its logits


@pytest.mark.parametrize("routing, mesh", [("dropless", "dp=8"), ("capacity", "ep=8"),
                                           ("grouped", "ep=8")])
def test_expert_flops_follow_the_routing_path(routing, mesh):
    """The cost model's executed FLOPs of a moe-tiny step against the compiled step's (loops
    by their trips; the later expert rounds, 0 near balance, left out): the padded dropless
    path runs E/k times the routed expert FLOPs, capacity its buffers, grouped its blocks
    (with routed FLOPs alone, dropless was 2.26x off)."""
    from jdist.config import TrainConfig
    from jdist.memory import compile_step
    from jdist.step.from_flags import plan_for
    from jdist.tools import gpu_report

    batch, seq = 8, 64
    plan = plan_for(TrainConfig.of(model="moe-tiny", mesh=mesh, batch_size=batch, seq_len=seq,
                                   moe_routing=routing, attention="xla"))[1]
    text = compile_step(plan, batch, seq).as_text()
    measured = gpu_report.report(text, plan.mesh, unknown_trips=0).executed_flops
    tokens = batch * seq / 8
    experts = expert_factor(plan.model, tokens, plan.mesh.shape[ax.EXPERT])
    predicted = cost.executed_flops(plan.model, seq, tokens, "xla", plan.compute.remat, False,
                                    plan.compute.loss, 1, experts)
    assert 0.9 <= measured / predicted <= 1.05, (measured, predicted)


def test_pipeline_bubble_weighs_backward_ticks():
    """With backward ticks 2x a forward, 1F1B on 2 stages x 2 micro-batches idles more than
    the tick count says, and more micro-batches shrink it."""
    small = cost.pipeline_bubble(PipelineConfig("1f1b", 2).table(2), "none")
    large = cost.pipeline_bubble(PipelineConfig("1f1b", 8).table(2), "none")
    assert small > PipelineConfig("1f1b", 2).table(2).bubble_fraction() * 0.99
    assert 0 < large < small < 0.5
    # Split backwards at P=4, M=8: ZB-H1 idles at most a third of 1F1B's time, ZB-V less
    # again; the planner enumerates both.
    weighted = {name: cost.pipeline_bubble(PipelineConfig(name, 8, v).table(4, stash=True),
                                           "none")
                for name, v in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2))}
    assert weighted["zbv"] < weighted["zb-h1"] <= weighted["1f1b"] / 3, weighted
    assert {("zb-h1", 8, 1), ("zbv", 8, 2)} <= set(layouts.pipelines(4, 8, 8))


def test_overlap_hides_replica_collectives_only():
    from jdist.tools.comm import Row
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


@pytest.mark.parametrize("accelerator, without_sp", [("cpu-sim", True), ("h100-80gb", False)])
def test_tensor_layouts_without_sp_give_way_to_collective_matmuls(accelerator, without_sp, capsys):
    """On GPUs a tensor-parallel layout with sequence parallelism runs its activation
    collectives as collective matmuls, beside its matmuls: the same layout without SP (whole
    all-reduces, more activation memory) is left out of the ranking there. The CPU simulation
    runs no collective matmuls, so both stay."""
    assert plan_main(["--model", "small", "--devices", "8", "--accelerator", accelerator,
                      "--batch-size", "16", "--seq-len", "128", "--fix", "tp=2,pp=1,sp=1",
                      "--json", "--top", "100"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    sp = ["--sequence-parallel" in r["flags"] for r in rows]
    assert any(sp) and (not all(sp)) == without_sp


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
    # One error line, after the lines saying what was searched (jdist.tools.progress).
    *progress, err = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("jdist: error: ")
    assert all(line.startswith("jdist: ") and "error" not in line for line in progress), progress
    for w in words:
        assert w in err, err


def test_unknown_profile_raises_config_error():
    with pytest.raises(ConfigError):
        load_profile("h100")


# llama3.1-70b's public shape, counted here rather than by jdist: parameters per layer (Q and
# O [8192, 64 x 128], K and V [8192, 8 x 128], SwiGLU 3 x [8192, 28672], two norm scales)
# and outside the layers (untied embedding and head [128256, 8192], the final norm scale).
LAYERS_70B, D_70B = 80, 8192
LAYER_PARAMS_70B = 2 * D_70B * 64 * 128 + 2 * D_70B * 8 * 128 + 3 * D_70B * 28_672 + 2 * D_70B
OUTER_PARAMS_70B = 2 * 128_256 * D_70B + D_70B
NORM_PARAMS_70B = (2 * LAYERS_70B + 1) * D_70B


def flag(flags: list[str], name: str, default: str) -> str:
    return flags[flags.index(name) + 1] if name in flags else default


def state_bounds_70b(flags: list[str]) -> dict[str, tuple[float, float]]:
    """(least, most) bytes per device of the float32 weights, gradients and Adam moments of
    the layout `flags`: every parameter split over fsdp x tensor (the layers, embedding and
    head also over the stages; ZeRO-1 splits the moments over data, ZeRO-2 the gradients
    too, ZeRO-3 all), and at most the norm scales (whole on every device) and Adam's step
    count above that."""
    mesh = {k: int(v) for k, v in (a.split("=") for a in flag(flags, "--mesh", "").split(","))}
    zero, data, stages = int(flag(flags, "--zero", "0")), mesh.get("dp", 1), mesh.get("pp", 1)
    split = mesh.get("fsdp", 1) * mesh.get("tp", 1) * mesh.get("ep", 1)
    least = 4 * ((LAYERS_70B * LAYER_PARAMS_70B + OUTER_PARAMS_70B - D_70B) / stages
                 + D_70B) / split
    bounds = {}
    for term, copies, zero_splits in (("params", 1, 3), ("grads", 1, 2), ("optimizer", 2, 1)):
        per = copies * least / (data if zero >= zero_splits else 1)
        bounds[term] = (per, per + copies * 4 * NORM_PARAMS_70B + 8)
    return bounds


def test_70b_on_64_h100s():
    """The acceptance command: a ranked table of 20 distinct 64-device layouts whose state
    bytes are what the public 70B shape gives, and every row's command line planned again
    by the trainer: its pre-compile checks pass and it predicts the memory the row ranked."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "plan_70b.py")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["plan"]["layouts"]
    assert len(rows) == 20 and out["checks"] == "passed"
    assert len({r["layout"] for r in rows}) == 20
    assert out["plan"]["command"] == rows[0]["command"]
    for r in rows:
        mesh = flag(r["flags"], "--mesh", "")
        assert math.prod(int(a.split("=")[1]) for a in mesh.split(",")) == 64, r["layout"]
        memory = r["memory"]
        assert memory["total"] == sum(memory[k] for k in
                                      ("params", "grads", "optimizer", "activations"))
        for term, (least, most) in state_bounds_70b(r["flags"]).items():
            assert least <= memory[term] <= most, (r["layout"], term, memory[term], least)
        assert r["tokens_per_s"] * r["step_s"] == pytest.approx(512 * 8192, rel=1e-9)
    assert out["replanned_totals"] == [r["memory"]["total"] for r in rows]
    steps = [r["step_s"] for r in rows]
    assert steps == sorted(steps)


def test_planner_memory_is_the_memory_tools(capsys):
    """The planner's GiB/dev of a layout is `python -m jdist.memory`'s predicted total for
    it: the planner prints that command (the same flags, on the devices it planned on; for
    a GPU target the memory tool needs `--target`, as a GPU compiler keeps other buffers
    than the CPU's, which the tool says without it)."""
    from jdist.memory.__main__ import main as memory_main
    from jdist.runtime.target import plugin_installed

    argv = ["--model", "small", "--devices", "8", "--accelerator", "h100-80gb", "--batch-size",
            "16", "--seq-len", "128", "--fix", "tp=2"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    header, first = out.splitlines()[1:3]
    end = header.index("GiB/dev") + len("GiB/dev")  # a right-aligned column
    gib = float(first[end - len("GiB/dev"):end])
    command = out.splitlines()[-1].split(": ", 1)[1]
    assert command.startswith("python -m jdist.memory ")
    # Without jax's CUDA plugin the planner plans on simulated CPUs, and says so.
    assert ("--target h100-80gb" in command) == plugin_installed()
    assert plan_main(argv + ["--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert row["memory_command"] == command

    assert memory_main(command.split()[3:] + ["--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]
    assert predicted == row["memory"]
    assert f"{predicted['total'] / 2**30:.2f}" == f"{gib:.2f}"
    if plugin_installed():
        assert memory_main(command.split(" --target")[0].split()[3:]) == 0
        assert "predicted for the XLA CPU compiler" in capsys.readouterr().out
