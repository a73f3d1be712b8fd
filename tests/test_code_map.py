"""docs/architecture.md is checked against the code: the spine of a dense step is at most
nine files, holds the functions a dense step runs, and every module the step builder
imports is either on the spine or listed under "read on demand"."""

import ast
import inspect
import re
from pathlib import Path

from test_structure import PACKAGES, ROOT, imports_of, module_name

MAP = ROOT / "docs" / "architecture.md"
BUILDER = "jdist.step.build"
FLAGS_TO_PLAN = "jdist.step.from_flags"  # where flags become a plan


def sections() -> tuple[list[str], list[str]]:
    """(the spine's paths in order, the on-demand paths) as the page lists them."""
    text = MAP.read_text()
    spine_text, demand_text = text.split("## Read on demand")
    spine = re.findall(r"^\d+\. `([^`]+)`", spine_text, re.M)
    demand = re.findall(r"^\| `([^`]+)` \|", demand_text, re.M)
    return spine, demand


def import_closure(start: str) -> set[str]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    paths = {module_name(p): p for p in files}
    graph = {m: imports_of(p, set(paths)) for m, p in paths.items()}
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def path_of(module: str) -> str:
    """The module's file in the repository."""
    base = ROOT / Path(*module.split("."))
    return repository_path(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))


def only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return len(body) == 1 and isinstance(body[0], ast.Expr) and \
        isinstance(body[0].value, ast.Constant)


def repository_path(path: Path) -> str:
    return str(path.resolve().relative_to(ROOT))


def test_spine_is_at_most_nine_files_on_the_builders_path():
    spine, _ = sections()
    assert 1 <= len(spine) <= 9, spine
    reachable = {path_of(m) for m in import_closure(BUILDER) | {FLAGS_TO_PLAN}}
    assert not set(spine) - reachable, set(spine) - reachable


def test_spine_holds_what_a_dense_step_runs():
    from jdist.config import groups
    from jdist.models import llama, loss
    from jdist.parallel import grad_sync
    from jdist.step import build, forward, from_flags, grads, state

    runs = [groups.MemoryFlags, from_flags.plan_for, state.make_plan, build.make_train_step,
            grads.step_grads, grad_sync.materialize, forward.chunk, llama.Llama.run_blocks,
            loss.piece_cross_entropy]
    spine, _ = sections()
    for obj in runs:
        where = repository_path(Path(inspect.getsourcefile(inspect.unwrap(obj))))
        assert where in spine, f"{obj.__qualname__} is defined in {where}, not on the spine"


def test_every_module_the_builder_imports_is_on_the_map():
    spine, demand = sections()
    listed = set(spine) | set(demand)
    for entry in demand:
        assert (ROOT / entry).exists(), f"the map names {entry}, which does not exist"
    missing = []
    for module in sorted(import_closure(BUILDER)):
        path = path_of(module)
        if only_a_docstring(ROOT / path):  # a folder's __init__ that holds no code
            continue
        if path not in listed and not any(d.endswith("/") and path.startswith(d)
                                          for d in demand):
            missing.append(path)
    assert not missing, f"add to docs/architecture.md: {missing}"
