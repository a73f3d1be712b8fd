"""The code's shape: packages stacked in layers (none imports one above it, none forms a
cycle with another), the model stands alone, and no module imports itself back."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from jdist.tools.imports import imports_of as module_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"jdist": "jdist"}  # directory of the project's code -> the package it installs as

# The layers, lowest first. A module may import from its own layer and those below, never
# from above. An entry is a package (or one module of one); a module belongs to its longest
# matching entry. `jdist` is the package's own __init__ (it picks the JAX platform, with the
# runtime's help).
LAYERS: list[tuple[str, set[str]]] = [
    ("errors and files", {"jdist.errors", "jdist.files"}),
    ("devices and named axes", {"jdist", "jdist.spmd", "jdist.runtime", "jdist.launch"}),
    ("models", {"jdist.models", "jdist.meshes"}),
    ("quantized numbers", {"jdist.quant"}),
    ("data and files", {"jdist.data", "jdist.checkpoint"}),
    ("kernels", {"jdist.parallel"}),
    ("Hugging Face files", {"jdist.hf"}),  # weights into a plan's layout, by its arguments
    ("flags", {"jdist.config"}),
    ("the step", {"jdist.step"}),
    ("export and inference", {"jdist.export", "jdist.generate"}),
    ("inspection", {"jdist.tools"}),
    ("the memory model", {"jdist.memory"}),
    ("the planner", {"jdist.plan"}),
    ("training", {"jdist.train"}),
]


def test_models_import_nothing_from_the_parallel_or_training_code():
    code = ("import sys, jdist.models; print(sorted(m for m in sys.modules "
            "if m.startswith(('jdist.parallel', 'jdist.train', 'jdist.step'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=120).stdout.strip()
    assert out == "[]", out


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    parts = (PACKAGES[parts[0]], *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules `path` imports anywhere, except under `if TYPE_CHECKING`."""
    return module_imports(ast.parse(path.read_text()), modules)


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each project module -> the project modules it imports (its parent packages aside:
    they run first anyway)."""
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    names = {p: module_name(p, root) for p in files}
    graph = {names[p]: imports_of(p, set(names.values())) for p in files}
    return {m: {d for d in deps if not m.startswith(d + ".") and d != m}
            for m, deps in graph.items()}


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def entry_of(module: str) -> str:
    entries = [e for _, group in LAYERS for e in group]
    found = [e for e in entries if module == e or module.startswith(e + ".")]
    assert found, f"{module} is in no layer: add its package to LAYERS"
    return max(found, key=len)


def layer_of(module: str) -> int:
    entry = entry_of(module)
    return next(i for i, (_, group) in enumerate(LAYERS) if entry in group)


def layer_violations(root: Path = ROOT) -> list[str]:
    """Every import of a module from a higher layer, and every cycle between layer entries
    (two packages of one layer importing each other)."""
    graph = module_graph(root)
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in sorted(graph.items()) for d in sorted(deps)
              if layer_of(d) > layer_of(m)]
    entries: dict[str, set[str]] = {}
    for m, deps in graph.items():
        entries.setdefault(entry_of(m), set()).update(
            entry_of(d) for d in deps if entry_of(d) != entry_of(m))
    return upward + [" -> ".join(c) for c in cycles_of(entries)]


def test_layers_import_downward_only():
    assert not layer_violations(), "\n".join(layer_violations())


def test_layer_check_finds_a_planted_upward_import(tmp_path):
    """The check is not vacuous: the model importing the training loop is caught."""
    shutil.copytree(ROOT / "jdist", tmp_path / "jdist")
    llama = tmp_path / "jdist" / "models" / "llama.py"
    llama.write_text(llama.read_text() + "\n\ndef _planted():\n    from jdist.train import loop\n")
    found = layer_violations(tmp_path)
    assert any(v.startswith("jdist.models.llama (models) imports jdist.train.loop") for v in found)
    assert any("jdist.models" in v and "jdist.train" in v and "->" in v for v in found)


def test_no_import_cycles():
    assert not cycles_of(module_graph()), cycles_of(module_graph())


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
