"""The import graph of the three packages runs one way (issue #18).

Walks every module of ``paas_common``, ``reference_server`` and ``paasbench`` with :mod:`ast` and builds the
module-to-module import graph from every import statement — at the top of a module and inside functions alike, since
a lazy import is still a dependency — then asserts the direction the layout promises (docs/architecture.md):

- no import cycle anywhere;
- ``reference_server`` never imports ``paasbench`` (a server readable, testable and shippable on its own);
- ``paas_common`` imports neither ``paasbench`` nor ``reference_server`` (the base both stand on).

An edge goes to the module an import names: ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else
to ``a.b``. The implicit import of parent packages is not an edge (a package ``__init__`` that re-exports its
submodules is not a cycle).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("paas_common", "paasbench", "reference_server")


def _modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        base = ROOT / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports (top-level and function-level imports)."""
    mods = _modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                # `import a.b.c` names a.b.c; keep the longest prefix that is one of our modules
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges_into(graph: dict[str, set[str]], src_pkg: str, dst_pkgs: tuple[str, ...]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if a.split(".")[0] == src_pkg
                  for b in deps if b.split(".")[0] in dst_pkgs)


def test_graph_sees_the_packages():
    graph = import_graph()
    # the walk must actually find modules and edges, or every assertion below would pass vacuously
    assert sum(1 for m in graph if m.startswith("paasbench.")) > 30
    assert sum(1 for m in graph if m.startswith("reference_server.")) > 20
    assert sum(len(d) for d in graph.values()) > 100


def test_no_import_cycle():
    assert _cycles(import_graph()) == []


def test_reference_server_never_imports_paasbench():
    assert _edges_into(import_graph(), "reference_server", ("paasbench",)) == []


def test_paas_common_imports_neither_side():
    graph = import_graph()
    assert any(m.startswith("paas_common") for m in graph), "paas_common is missing"
    assert _edges_into(graph, "paas_common", ("paasbench", "reference_server")) == []


def test_python_m_reference_server_loads_no_paasbench():
    """``python -m reference_server --help`` runs without importing the harness at all."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['reference_server', '--help']\n"
             "try:\n"
             "    runpy.run_module('reference_server', run_name='__main__', alter_sys=True)\n"
             "except SystemExit as e:\n"
             "    assert e.code in (0, None), e.code\n"
             "loaded = sorted(m for m in sys.modules if m == 'paasbench' or m.startswith('paasbench.'))\n"
             "print('PAASBENCH_MODULES', loaded)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout
    assert "PAASBENCH_MODULES []" in out.stdout, out.stdout[-2000:]
