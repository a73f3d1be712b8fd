"""The health line (`jdist.train.slowdown`): systems slowdown or numerics/data anomaly.

The classifier is judged on a recorded step series: `fixtures/steps_tiny_fsdp8.jsonl` is
step, loss and tokens/s of a real 300-step run (`--model tiny --mesh fsdp=8 --batch-size 8
--seq-len 32`) on 2 CPU cores shared with other work, whose throughput swung between 3k and
18k tokens/s; then on that series with a slowdown, a loss spike or a NaN written in. A real
run checks the wiring: a NaN step (`--inject-nan-at-step`) and a slow host from step 21
(`--inject-straggler 0:0.5:21`) read back from metrics.jsonl, TensorBoard and the console,
with the hardware fields beside them (memory: null on CPU; the collective share)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jdist.train import slowdown

RECORDED = Path(__file__).parent / "fixtures" / "steps_tiny_fsdp8.jsonl"


def recorded() -> list[dict]:
    return [json.loads(x) for x in RECORDED.read_text().splitlines()]


def verdicts(steps: list[dict], every: int) -> dict[int, str]:
    monitor = slowdown.Monitor(every)
    out = {r["step"]: monitor.add(r, last=r is steps[-1]).get("health") for r in steps}
    return {s: v for s, v in out.items() if v is not None}


def test_the_recorded_run_is_ok_at_its_log_interval():
    assert set(verdicts(recorded(), 50).values()) == {"ok"}


def test_a_falling_noisy_loss_is_never_an_anomaly():
    """Every 5 steps on the recorded run: its loss (5.6 -> 2.4) is never called a spike;
    what the shared host's load did to throughput is called systems, with the loss normal."""
    found = verdicts(recorded(), 5)
    assert len(found) == 58  # from the third interval
    assert all(v == "ok" or (v.startswith("systems: throughput -") and
                             v.endswith("vs median, loss normal")) for v in found.values())


def test_slowdown_spike_nan_and_both():
    steps = recorded()
    slow = [{**r, "tokens_per_sec": r["tokens_per_sec"] / 3} if r["step"] > 200 else r
            for r in steps]
    assert verdicts(slow, 50)[250].startswith("systems: throughput -6")  # -6x%
    assert verdicts(slow, 50)[250].endswith("vs median, loss normal")

    spike = [{**r, "loss": r["loss"] + 2.0} if r["step"] == 230 else r for r in steps]
    found = verdicts(spike, 50)
    assert found[250].startswith("numerics/data: loss spike z=")
    assert found[250].endswith(", throughput steady")
    assert float(found[250].split("z=")[1].split(",")[0]) > slowdown.Z
    assert found[200] == found[300] == "ok"

    both = [{**r, "loss": r["loss"] + 2.0} if r["step"] == 230 else r for r in slow]
    assert verdicts(both, 50)[250].startswith("both: throughput -6")
    assert verdicts(both, 50)[250].split(", ")[1].startswith("loss spike z=")

    nan = [{**r, "loss": math.nan} if r["step"] == 140 else r for r in steps]
    assert verdicts(nan, 50)[150] == "numerics/data: loss not finite, throughput steady"


def test_verdict_before_a_baseline():
    assert slowdown.verdict(None, None, False) == \
        "numerics/data: loss not finite, throughput not judged yet"
    assert slowdown.verdict(-0.2, 1.0, True) == "ok"  # within DROP
    monitor = slowdown.Monitor(2)
    assert [monitor.add({"step": s, "loss": 1.0, "tokens_per_sec": 10.0}) for s in (1, 2)] \
        == [{}, {}]  # nothing to judge against: no verdict


def test_a_real_run_reports_health_memory_and_collectives(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    args = ["--model", "tiny", "--mesh", "fsdp=8", "--steps", "25", "--batch-size", "8",
            "--seq-len", "32", "--log-every", "5", "--eval-every", "0", "--tensorboard",
            "--profile-steps", "6-7", "--inject-nan-at-step", "13", "--on-nan", "skip",
            "--inject-straggler", "0:0.5:21", "--run-dir", str(run_dir)]
    out = subprocess.run([sys.executable, "-m", "jdist.train", *args], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    records = {r["step"]: r for r in map(json.loads,
                                         (run_dir / "metrics.jsonl").read_text().splitlines())}
    # The NaN's interval (11-15) is numerics/data (or both, if the shared host slowed then
    # too); the slept interval (21-25) is systems with the loss normal.
    assert "loss not finite" in records[15]["health"] and records[15]["health_code"] in (2, 3)
    assert records[25]["health"].startswith("systems: throughput -"), records[25]
    assert records[25]["health"].endswith("loss normal") and records[25]["health_code"] == 1
    assert records[25]["throughput_change"] < -slowdown.DROP
    assert f"jdist: health: step 25: {records[25]['health']}" in out.stderr.splitlines()
    assert all("health" not in r for s, r in records.items() if s % 5)
    for r in records.values():  # jax 0.10.2's CPU memory_stats() is None: null, not 0
        assert r["memory_in_use_bytes"] is None and r["memory_peak_bytes_by_device"] is None
    assert all(r["comm_fraction"] > 0 for s, r in records.items() if s in (6, 7))
    progress = [x for x in out.stdout.splitlines() if x.startswith("step ")]
    assert progress and all(" | mem n/a | " in x for x in progress)
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("profile of steps 6-7: ")]
    mean = (records[6]["comm_fraction"] + records[7]["comm_fraction"]) / 2
    assert f"collectives {mean:.1%} of device time" in line

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    codes = {e.step: e.value for e in events.Scalars("health_code")}
    assert codes == {s: r["health_code"] for s, r in records.items() if "health_code" in r}
    assert {e.step for e in events.Scalars("comm_fraction")} == {6, 7}
    texts = {e.step: e.tensor_proto.string_val[0].decode()
             for e in events.Tensors("health/text_summary")}
    assert texts[25] == records[25]["health"]
    assert not any(t.startswith("memory") for t in events.Tags()["scalars"])


@pytest.mark.parametrize("text", ["0:0.5:0", "0:0.5:2:3", "0:x", "0"])
def test_inject_straggler_rejects(text):
    from jdist.errors import ConfigError
    from jdist.train.straggler import parse_injection

    with pytest.raises(ConfigError, match="--inject-straggler"):
        parse_injection(text)
    assert parse_injection("1:0.5") == (1, 0.5, 1)
    assert parse_injection("0:0.2:21") == (0, 0.2, 21)
