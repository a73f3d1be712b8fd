"""The project's import graph as its source says it: which project modules a file imports
(function-body imports too: a lazy import is still a dependency). Read by the layer test
(tests/test_structure.py) and benchmarks/code_shape.py, without importing anything."""

from __future__ import annotations

import ast


def imports_of(tree: ast.AST, modules: set[str]) -> set[str]:
    """The project modules a file's tree imports anywhere, except under `if TYPE_CHECKING`
    (relative imports are resolved by the caller's package; jdist uses none)."""
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found
