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
