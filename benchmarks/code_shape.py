"""The code's shape: what a reader meets in the `jdist` package, counted from its source.

    python benchmarks/code_shape.py [--root DIR] [--json]

Over the Python files of `jdist` under `--root` (default: this repository; any checkout
works, an old one included: `jdist/models` and `jdist/meshes` that link to top-level
`models/` and `meshes/` are followed, and each file is counted once, under the name it is
imported by):

  1. root modules: the files directly in `jdist/` (`jdist/*.py`, `__init__.py` included);
  2. package cycles: the import graph collapsed onto jdist's top-level packages and modules
     (`jdist.X`, X the first component after `jdist`; `jdist` itself is the package's own
     `__init__`). An import anywhere in a file counts, function bodies included, except
     under `if TYPE_CHECKING`; a module's import of its own parent packages does not. The
     strongly connected components of more than one node are the cycles; the count is the
     packages that take part in one;
  3. the 5 longest functions (methods and nested functions included; lines from `def` to
     the last line of the body), each with the `def`s and `lambda`s nested inside it;
  4. numbers in comments: `#` comments (one per line) and docstrings (module, class and
     function) that hold a percentage (`12%`, `2.5 %`), and the mentions of a jax version
     (`jax 0.10`, any case) in each.

Nothing of the measured tree is imported or run: its files are parsed (`ast`, `tokenize`;
the import walker is `jdist.tools.imports`, shared with the layer test).
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

import common
from common import Column

from jdist.tools.imports import imports_of

PERCENT = re.compile(r"\d+(\.\d+)?\s*%")
JAX_VERSION = re.compile(r"\bjax \d+\.\d+", re.IGNORECASE)
LONGEST = 5


def package_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every `.py` under `root/jdist` (symbolic links to folders
    followed; a file reached twice is kept under its first name, in sorted walk order)."""
    found: dict[str, Path] = {}
    seen: set[Path] = set()
    base = root / "jdist"
    for folder, dirs, files in os.walk(base, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            parts = ("jdist", *path.relative_to(base).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def top(module: str) -> str:
    """`jdist.X` of a module (`jdist` for the package's own __init__)."""
    return ".".join(module.split(".")[:2])


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of `graph`, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top_node = stack.pop()
                on_stack.discard(top_node)
                component.append(top_node)
                if top_node == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def package_cycles(trees: dict[str, ast.AST]) -> dict:
    modules = set(trees)
    graph: dict[str, set[str]] = {}
    for module, tree in trees.items():
        deps = {d for d in imports_of(tree, modules)
                if d != module and not module.startswith(d + ".")}
        graph.setdefault(top(module), set()).update(
            top(d) for d in deps if top(d) != top(module))
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    return {"packages": len(graph), "edges": sum(len(d) for d in graph.values()),
            "cycles": sorted(cycles, key=lambda c: (-len(c), c)),
            "in_cycles": sum(len(c) for c in cycles)}


def functions(module: str, path: Path, tree: ast.AST, root: Path) -> list[dict]:
    """Every function of a file with its length and the closures nested in it."""
    rows = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                nested = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                             for n in ast.walk(child) if n is not child)
                rows.append({"function": name, "module": module,
                             "file": str(path.relative_to(root)),
                             "line": child.lineno, "lines": child.end_lineno - child.lineno + 1,
                             "closures": nested})
                walk(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return rows


def docstrings(tree: ast.AST) -> list[str]:
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return [d for d in (ast.get_docstring(n, clean=False) for n in nodes) if d]


def comments(source: str) -> list[str]:
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.COMMENT]


def numbers_in_comments(sources: dict[str, str], trees: dict[str, ast.AST]) -> dict:
    out = {}
    for kind, texts in (("comments", [c for s in sources.values() for c in comments(s)]),
                        ("docstrings", [d for t in trees.values() for d in docstrings(t)])):
        out[kind] = {"total": len(texts),
                     "with_percentage": sum(bool(PERCENT.search(t)) for t in texts),
                     "percentages": sum(len(PERCENT.findall(t)) for t in texts),
                     "with_jax_version": sum(bool(JAX_VERSION.search(t)) for t in texts),
                     "jax_versions": sum(len(JAX_VERSION.findall(t)) for t in texts)}
    return out


def measure(root: Path) -> dict:
    files = package_files(root)
    sources = {m: p.read_text() for m, p in files.items()}
    trees = {m: ast.parse(s, str(files[m])) for m, s in sources.items()}
    every = [f for m, p in files.items() for f in functions(m, p, trees[m], root)]
    longest = sorted(every, key=lambda f: (-f["lines"], f["module"], f["line"]))[:LONGEST]
    roots = sorted(p.name for p in (root / "jdist").glob("*.py"))
    return {"root": str(root), "files": len(files),
            "lines": sum(s.count("\n") for s in sources.values()),
            "root_modules": {"count": len(roots), "names": roots},
            "package_cycles": package_cycles(trees),
            "functions": len(every), "longest_functions": longest,
            "numbers_in_comments": numbers_in_comments(sources, trees)}


def text(result: dict):
    r, c, n = result, result["package_cycles"], result["numbers_in_comments"]
    yield f"{r['root']}: {r['files']} files, {r['lines']} lines, {r['functions']} functions"
    yield ""
    yield f"modules at the jdist/ root: {r['root_modules']['count']}"
    yield "  " + " ".join(r["root_modules"]["names"])
    yield ""
    yield (f"top-level packages/modules: {c['packages']}, edges between them: {c['edges']}, "
           f"taking part in a cycle: {c['in_cycles']}")
    for cycle in c["cycles"]:
        yield f"  cycle of {len(cycle)}: " + " ".join(m.removeprefix("jdist.") for m in cycle)
    yield ""
    yield f"the {LONGEST} longest functions:"
    yield from common.table(r["longest_functions"], (
        Column("lines", ">5"), Column("closures", ">8"), Column("function", "<40"),
        Column("file:line", "<45", lambda f: f"{f['file']}:{f['line']}")))
    yield ""
    yield from common.table([{"kind": k, **v} for k, v in n.items()], (
        Column("in", "<10", "kind"), Column("total", ">6"),
        Column("with N%", ">8", "with_percentage"), Column("N% seen", ">8", "percentages"),
        Column("with jax X.Y", ">12", "with_jax_version"),
        Column("jax X.Y seen", ">12", "jax_versions")))


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--root", type=Path, default=common.ROOT,
                        help="a checkout holding jdist/ (default: this repository)")
    args = parser.parse_args()
    if not (args.root / "jdist").is_dir():
        parser.error(f"{args.root} has no jdist/ folder")
    result = measure(args.root.resolve())
    common.emit(result, args.json, lambda: text(result), indent=2)


if __name__ == "__main__":
    main()
