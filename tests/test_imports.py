"""Imports flow one way, with no cycles, counting function-level imports too.

Layers: ``kernels_pallas`` <- ``jaxlm`` <- ``trainers`` <- ``configs``: a package never
imports one to its right. Within and across them the module graph is acyclic. An edge runs
from a module to every module an ``import`` statement in it (at any depth) executes: the
named module and the ``__init__`` of each package above it that the importer is not itself
inside (``from a.b import c`` runs ``a/__init__`` and ``a/b/__init__`` first, and ``a.b.c``
if it is a module). A cycle in that graph is an import-order bug waiting for the right
entry point. Function-level imports of project modules are allowed only where a module is
lazy by design (listed below with the reason); everywhere else they hid cycles.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("kernels_pallas", "jaxlm", "trainers", "configs")

#: modules whose function-level imports of project modules are deliberate, and why
LAZY_BY_DESIGN = {
    "trainers.cli": "parsing arguments and printing --help must not wait for JAX to import",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def _is_package(modules: dict[str, Path], name: str) -> bool:
    return modules[name].name == "__init__.py"


def _imports(modules: dict[str, Path], name: str):
    """``(target module, function-level?, line)`` for each project module an import in
    ``name`` names."""
    path = modules[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if _is_package(modules, name) else name.rpartition(".")[0]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, nested, child.lineno
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    yield (full if full in modules else base), nested, child.lineno
            yield from visit(child, nested)

    for target, nested, line in visit(tree, False):
        if target in modules:
            yield target, nested, line


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    where: dict[tuple[str, str], str] = {}
    function_level = []
    for name in modules:
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for target, nested, line in _imports(modules, name):
            if nested and target.split(".")[0] in LAYERS:
                function_level.append(f"{modules[name].relative_to(ROOT)}:{line} imports {target}")
            parts = target.split(".")
            executed = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - own_packages - {name}
            for t in executed:
                if t in modules:
                    edges[name].add(t)
                    where.setdefault((name, t), f"{modules[name].relative_to(ROOT)}:{line}")
    return modules, edges, where, function_level


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = itertools.count()

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_packages_import_only_to_their_left():
    _, edges, where, _ = _graph()
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [f"{where[(m, t)]}: {m} -> {t}" for m in edges for t in edges[m]
              if rank[t.split(".")[0]] > rank[m.split(".")[0]]]
    assert not upward, "imports against kernels_pallas <- jaxlm <- trainers <- configs:\n" + "\n".join(sorted(upward))


def test_the_module_graph_has_no_cycles():
    _, edges, where, _ = _graph()
    cycles = _cycles(edges)
    report = []
    for comp in cycles:
        members = set(comp)
        report.append("cycle: " + ", ".join(comp))
        report += [f"  {where[(m, t)]}: {m} -> {t}" for m in comp for t in sorted(edges[m] & members)]
    assert not cycles, "\n".join(report)


def test_function_level_imports_of_project_modules_only_where_lazy_by_design():
    modules, _, _, function_level = _graph()
    lazy_files = {str(modules[m].relative_to(ROOT)) for m in LAZY_BY_DESIGN}
    hidden = [f for f in function_level if f.split(":")[0] not in lazy_files]
    assert not hidden, "function-level imports of project modules (move them to the top):\n" + "\n".join(hidden)


@pytest.mark.parametrize("files, cycle", [
    # a package __init__ importing a submodule that, through a sibling, imports the package
    ({"a/__init__.py": "from a.b import f", "a/b.py": "import a.c\ndef f(): pass", "a/c.py": "from a import b"}, True),
    ({"a/__init__.py": "", "a/b.py": "from a.c import g", "a/c.py": "g = 1"}, False),
    # a function-level import closes the cycle
    ({"a/__init__.py": "", "a/b.py": "def f():\n    from a.c import g", "a/c.py": "from a.b import f\ng = 1"}, True),
    # a package importing its own submodule is not a cycle
    ({"a/__init__.py": "from a import b", "a/b.py": "from a.c import g", "a/c.py": "g = 1"}, False),
    # x.y imports a.b, which runs a/__init__, which imports x.z, which imports x.y
    ({"a/__init__.py": "import x.z", "a/b.py": "", "x/__init__.py": "", "x/y.py": "from a.b import f",
      "x/z.py": "import x.y"}, True),
])
def test_the_checker_sees_package_init_and_function_level_cycles(tmp_path, monkeypatch, files, cycle):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text + "\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "LAYERS", tuple(sorted({rel.split("/")[0] for rel in files})))
    _, edges, _, _ = _graph()
    assert bool(_cycles(edges)) == cycle, edges
