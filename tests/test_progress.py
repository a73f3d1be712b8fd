"""Long commands say on stderr what they are doing (`jdist.tools.progress`) and keep XLA's
C++ log lines off it (`jdist.runtime.compiler_logs`)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jdist.runtime import compiler_logs

ROOT = Path(__file__).resolve().parents[1]
# XLA's C++ log lines: `W1205 18:49:25.220600   13936 gpu_collective_performance_model.cc:407]`.
XLA_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]")


@pytest.mark.gpu_compiler
def test_plan_verify_shows_progress_and_no_compiler_logs():
    """Verifying tiny's fsdp=4,tp=2 for an H100 target compiles it with XLA's GPU compiler,
    which logs a warning for each collective it cannot time (16 lines here, with
    TF_CPP_MIN_LOG_LEVEL=0) and INFO lines: none reach stderr, which holds the search's
    and the compile's progress instead."""
    env = {k: v for k, v in os.environ.items() if k != compiler_logs.LEVEL}
    result = subprocess.run(
        [sys.executable, "-m", "jdist.plan", "--model", "tiny", "--devices", "8",
         "--accelerator", "h100-80gb", "--batch-size", "8", "--seq-len", "64",
         "--fix", "fsdp=4", "--fix", "tp=2", "--verify", "1"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert not [line for line in lines if XLA_LOG.match(line)], result.stderr
    assert all(line.startswith("jdist: ") for line in lines), result.stderr
    assert lines[0] == "jdist: searching the layouts of tiny on 8 devices, by mesh shape ..."
    assert re.fullmatch(r"jdist: searching .*: done in [\d.]+ s", lines[1]), lines
    assert any(re.fullmatch(r"jdist: compiling the best layouts for 8 x h100-80gb until 1 "
                            r"fit: 0 of 1, compiling fsdp=4,tp=2 .*\(\d+ s\)", line)
               for line in lines), lines
    assert re.fullmatch(r"jdist: compiling the best layouts .*: done in [\d.]+ s", lines[-1])
    assert "verified ranking" in result.stdout


def test_a_log_level_the_user_set_is_kept(monkeypatch):
    """TF_CPP_MIN_LOG_LEVEL=0 shows XLA's lines again: the commands only set a default."""
    monkeypatch.setenv(compiler_logs.LEVEL, "0")
    compiler_logs.quiet_compiler()
    assert os.environ[compiler_logs.LEVEL] == "0"
    monkeypatch.delenv(compiler_logs.LEVEL)
    compiler_logs.quiet_compiler()
    assert os.environ[compiler_logs.LEVEL] == "3"
