"""The fast tier's list of slow tests (tests/slow.txt) names only tests that exist: a renamed
test or parameter set would otherwise drop out of the list silently and slow the fast tier."""

import ast
import os
import subprocess
import sys
from pathlib import Path

from conftest import SLOW_LIST, slow_entries

TESTS = Path(__file__).parent


def test_every_slow_entry_names_a_test():
    entries = sorted(slow_entries(SLOW_LIST.read_text()))
    missing, with_params = [], set()
    for entry in entries:
        file, _, function = entry.partition("::")
        path = TESTS / file
        if not path.exists():
            missing.append(f"{entry} (no such file)")
            continue
        names = {n.name for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.FunctionDef)}
        if function and function.split("[")[0] not in names:
            missing.append(f"{entry} (no such test)")
        elif "[" in function:
            with_params.add(file)
    if with_params:  # parameter ids exist only once collected
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-n0",
                                 "-p", "no:cacheprovider", *sorted(with_params)],
                                capture_output=True, text=True, cwd=TESTS, timeout=300,
                                # this checkout's jdist, not whichever one pip installed
                                env={**os.environ, "PYTHONPATH": str(TESTS.parent)}).stdout
        ids = {line.split("/")[-1] for line in listed.splitlines() if "::" in line}
        missing += [f"{e} (no such parameters)" for e in entries if "[" in e and e not in ids]
    assert not missing, missing
