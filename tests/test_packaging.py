"""The installed package: a wheel built from this checkout installs `jdist` alone (the model
and the mesh presets inside it, as `jdist.models` and `jdist.meshes`, so a user's own
`models/` is never shadowed), and imports and trains from outside the checkout."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_jdist_alone_and_trains(tmp_path):
    # `pip install .` as a user runs it (pip builds the wheel in its own environment); the
    # dependencies come from this one (--system-site-packages, --no-deps).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True,
                               timeout=60).stdout.strip())
    before = set(p.name for p in site.iterdir())
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", str(ROOT)],
                   check=True, timeout=600, capture_output=True, cwd=tmp_path)
    new = sorted(p.name for p in site.iterdir() if p.name not in before
                 and not p.name.endswith(".dist-info"))
    assert new == ["jdist"], new  # no top-level `models` or `meshes`
    code = ("import json, jdist, jdist.models, jdist.spmd.mesh; print(json.dumps({'jdist': "
            "jdist.__file__, 'presets': jdist.spmd.mesh.preset_names()}))")
    out = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True,
                                    text=True, cwd=tmp_path, env=env, timeout=120).stdout)
    assert out["jdist"].startswith(str(site)), out  # the wheel's, not the checkout's
    assert "cpu-8" in out["presets"]
    run = subprocess.run([python, "-m", "jdist.train", "--model", "tiny", "--steps", "2",
                          "--mesh", "cpu-8", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r][-1] == 2


def test_the_dev_install_pulls_no_cuda_wheels(tmp_path):
    """`pip install -e ".[dev]"` (the README's first command) resolves to CPU jax: no CUDA
    plugin, no NVIDIA libraries (5.5 GB of them); the cuda12 extra adds them. Resolved by
    pip against the package index, nothing installed."""
    # Both resolutions at once: each is mostly waiting on the index (40 s of wall for 8 s
    # of CPU, measured 2026-12-06), so together they take about one's time.
    reports = {extras: tmp_path / f"{extras}.json" for extras in ("dev", "dev,cuda12")}
    pips = {extras: subprocess.Popen(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
         "--report", str(report), "-e", f"{ROOT}[{extras}]"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for extras, report in reports.items()}
    for extras, pip in pips.items():
        _, err = pip.communicate(timeout=300)
        assert pip.returncode == 0, (extras, err[-2000:])
    resolved = {extras: [p["metadata"]["name"].lower()
                         for p in json.loads(report.read_text())["install"]]
                for extras, report in reports.items()}

    cuda = lambda names: sorted(n for n in names if "cuda" in n or n.startswith("nvidia"))
    dev = resolved["dev"]
    assert {"jax", "jaxlib", "pytest"} <= set(dev) and cuda(dev) == [], cuda(dev)
    assert "jax-cuda12-plugin" in cuda(resolved["dev,cuda12"])


def test_gpu_compiler_tests_skip_without_the_cuda_extra_unless_required(tmp_path):
    """Without jax's CUDA plugin (hidden here by a regular `jax_plugins` package first on the
    path) a `gpu_compiler` test skips and names the extra; with JDIST_REQUIRE_CUDA_PLUGIN=1,
    as CI sets it, the same test fails."""
    (tmp_path / "jax_plugins").mkdir()
    (tmp_path / "jax_plugins" / "__init__.py").write_text("")
    test = "tests/test_gpu_target.py::test_cuda_plugin_is_installed"

    def run(require: str):
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "JDIST_REQUIRE_CUDA_PLUGIN": require}
        return subprocess.run([sys.executable, "-m", "pytest", "-n0", "-rs", "-p",
                               "no:cacheprovider", test], capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=300)

    skipped, required = run("0"), run("1")
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    assert '".[cuda12]"' in skipped.stdout, skipped.stdout[-2000:]
    assert required.returncode == 1 and "1 failed" in required.stdout, required.stdout[-2000:]
