"""The README's commands and custom training loop work as written."""

import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_starts_with_install_and_test_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL).group(1).strip().splitlines()
    assert first_block == ['pip install -e ".[dev]" && python -m jdist.train', "python -m pytest"]


def test_custom_loop_runs_as_written(tmp_path):
    code = README.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, result.stdout
