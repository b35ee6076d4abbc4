"""The package's layers (docs/architecture.md): each folder imports only the folders below it, and no modules import
each other in a circle. Every `import` counts, also those inside functions; imports under `if TYPE_CHECKING:` count
for the layer order but not for circles (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import ggml_py

# (rank, folder): a module may import a module of a lower rank or of its own folder. Folders of one rank are peers
# and must not import each other. The root modules errors/counters/sysmem/gcpause are the base every layer may use; the
# package's own __init__ and __main__ are the facade above everything.
LAYERS = {
    "ggml_py.errors": 0, "ggml_py.counters": 0, "ggml_py.sysmem": 0, "ggml_py.gcpause": 0,
    "ggml_py.ir": 1,
    "ggml_py.runtime": 2,
    "ggml_py.formats": 3,
    "ggml_py.models": 4, "ggml_py.testing": 4,
    "ggml_py.cluster": 5,
    "ggml_py.serving": 6,
    "ggml_py.commands": 7,
    "ggml_py": 8,
}


def layer_of(module: str) -> str:
    """The LAYERS key a module belongs to: the longest one that is the module or a package containing it."""
    best = "ggml_py"
    for key in LAYERS:
        if (module == key or module.startswith(key + ".")) and len(key) > len(best):
            best = key
    return best


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for m in n.body:
                lines.update(range(m.lineno, (m.end_lineno or m.lineno) + 1))
    return lines


def imports_of(root: Path) -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported module, line, runs)] for every module of the package rooted at `root`; `runs` is False
    for an import under TYPE_CHECKING. `from pkg import name` is pkg.name where that is a module of the package."""
    files = {module_name(root, p): p for p in root.rglob("*.py")}
    out: dict[str, list[tuple[str, int, bool]]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        static = _type_checking_lines(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: list[tuple[str, int, bool]] = []
        for n in ast.walk(tree):
            targets: list[str] = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                    base = ".".join(up + ([n.module] if n.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in n.names]
            for t in targets:
                if t.split(".")[0] == root.name and t != mod:
                    found.append((t, n.lineno, n.lineno not in static))
        out[mod] = found
    return out


def upward_imports(graph: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        a = layer_of(mod)
        for dep, line, _ in deps:
            b = layer_of(dep)
            if a != b and LAYERS[b] >= LAYERS[a]:
                bad.append(f"{mod}:{line} imports {dep} ({b} is not below {a})")
    return bad


def circles(graph: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """Every circle of imports that run, each once (Tarjan's strongly connected components of size > 1)."""
    edges = {m: sorted({d for d, _, runs in deps if runs and d in graph}) for m, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    root = Path(ggml_py.__file__).parent
    graph = imports_of(root)
    assert len(graph) > 60
    for folder in ("ir", "runtime", "formats", "models", "cluster", "serving", "commands", "testing"):
        assert f"ggml_py.{folder}" in graph, f"ggml_py/{folder}/ is missing"
    stray = [m for m in graph if layer_of(m) == "ggml_py" and m not in ("ggml_py", "ggml_py.__main__")]
    assert not stray, f"modules outside every layer folder: {stray}"


def test_no_import_from_a_higher_layer():
    bad = upward_imports(imports_of(Path(ggml_py.__file__).parent))
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    found = circles(imports_of(Path(ggml_py.__file__).parent))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "ggml_py"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_the_check_sees_an_upward_import_and_a_circle(tmp_path):
    """The checks above are not vacuous: a runtime module reaching up into models, and two ir modules importing
    each other (one of them inside a function, as a lazy import), are both reported."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "ir/__init__.py": "",
        "ir/tensor.py": "def f():\n    from ggml_py.ir.ops import add\n",
        "ir/ops.py": "from ggml_py.ir import tensor\n",
        "runtime/__init__.py": "",
        "runtime/plan.py": "from ggml_py.models.model import Model\n",
        "models/__init__.py": "",
        "models/model.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ggml_py.models import x\n",
    })
    graph = imports_of(root)
    assert upward_imports(graph) == [
        "ggml_py.runtime.plan:1 imports ggml_py.models.model (ggml_py.models is not below ggml_py.runtime)"]
    assert circles(graph) == [["ggml_py.ir.ops", "ggml_py.ir.tensor"]]
