"""The GPU benchmark's path runs on CPU (tiny model), so it is known to work before a GPU
session spends its minutes on it."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_runs_each_attention_on_the_tiny_model():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny",
                          "--steps", "2", "--json"], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    result = json.loads(out)
    assert [r["attention"] for r in result["rows"]] == ["xla", "flash"]  # no cuDNN on CPU
    for row in result["rows"]:
        assert row["loss_finite"] and row["tokens_per_s"] > 0 and row["compiled_peak_bytes"] > 0
        assert 0 < row["mfu_measured_peak"] and row["layers"] == row["of_layers"]
    assert result["measured_matmul_tflops"] > 0
    assert result["attention_max_rel_error_vs_f32_dense"]["flash"] < 1e-5


def test_gpu_benchmark_compares_fp8_with_the_compute_dtype():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny",
                          "--steps", "2", "--fp8", "rowwise", "--json"], capture_output=True,
                         text=True, timeout=600, check=True).stdout
    result = json.loads(out)
    assert [(r["attention"], r["fp8"]) for r in result["rows"]] == \
        [("flash", "off"), ("flash", "rowwise")]
    assert all(r["loss_finite"] for r in result["rows"])
    losses = [r["final_loss"] for r in result["rows"]]
    assert losses[0] != losses[1]  # FP8 ran
    assert result["fp8_speedup"]["tiny"]["ratio"] > 0


def test_tokenize_benchmark_runs_on_a_small_input():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tokenization.py"), "--max-mb",
                          "0.5", "--vocab", "1024", "--json"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    result = json.loads(out)
    assert result["identical_ids"] and all(r["mb_per_s"] > 0 for r in result["rows"])


def test_memory_benchmarks_name_the_cuda_extra_when_a_gpu_target_lacks_the_plugin(tmp_path):
    """`--target` on a machine without jax's CUDA plugin: one line naming the extra, exit 2
    (a regular `jax_plugins` package first on the path hides an installed plugin)."""
    (tmp_path / "jax_plugins").mkdir()
    (tmp_path / "jax_plugins" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    for script in ("zero_memory.py", "compute_path.py", "finetune_memory.py"):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--target",
                               "h100-80gb"], capture_output=True, text=True, env=env,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and '".[cuda12]"' in lines[0] and not done.stdout, done.stderr


def test_suite_schedule_replays_a_late_long_test_as_an_idle_tail(tmp_path, capsys,
                                                                 monkeypatch):
    """benchmarks/suite_schedule.py on a made-up suite: 40 one-second tests, then a 30 s
    one. Collected last, it runs while the other worker idles; moved first, it does not."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from suite_schedule import main

    ids = [f"tests/t.py::test_{i}" for i in range(40)] + ["tests/t.py::test_long"]
    (tmp_path / "ids.txt").write_text("\n".join(ids))
    (tmp_path / "log").write_text("\n".join(
        f"{30.0 if i.endswith('long') else 1.0}s call     {i}" for i in ids))
    main([str(tmp_path / "ids.txt"), str(tmp_path / "log"), "--total-wall", "35",
          "--first", "tests/t.py::test_long", "--json"])
    rows = {r["order"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["collection order"]["idle_tail_s_mean"] >= 20
    assert rows["named tests first"]["idle_tail_s_mean"] <= 1
    assert rows["named tests first"]["wall_s_median"] == 35
