"""The code's shape: the model stands alone, and no module imports itself back."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Directories of the project's code and the package each installs as (jdist/models links to
# models/, which rglob does not follow).
PACKAGES = {"jdist": "jdist", "models": "jdist.models"}


def test_models_import_nothing_from_the_parallel_or_training_code():
    code = ("import sys, jdist.models; print(sorted(m for m in sys.modules "
            "if m.startswith(('jdist.parallel', 'jdist.train', 'jdist.step'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=120).stdout.strip()
    assert out == "[]", out


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = (PACKAGES[parts[0]], *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules `path` imports anywhere (function bodies included: a lazy import is
    still a dependency), except under `if TYPE_CHECKING`."""
    tree = ast.parse(path.read_text())
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


def test_no_import_cycles():
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports_of(p, modules) for p in files}
    for name, deps in graph.items():  # a module's own parent packages run first anyway
        graph[name] = {d for d in deps if not name.startswith(d + ".") and d != name}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_parameter_tree_names_are_the_models():
    """`models.names` spells the top-level parameter names everyone imports; they must be
    the attributes `models.Llama` actually has (tied: no head)."""
    from flax import nnx

    from jdist.models import Llama, get_preset
    from jdist.models.names import BLOCKS, EMBED, FINAL_NORM, HEAD

    for tied in (False, True):
        cfg = get_preset("tiny", tie_embeddings=tied)
        state = nnx.state(nnx.eval_shape(lambda c=cfg: Llama(c, rngs=nnx.Rngs(0))))
        expected = {EMBED, BLOCKS, FINAL_NORM} | (set() if tied else {HEAD})
        assert set(nnx.to_pure_dict(state)) == expected
