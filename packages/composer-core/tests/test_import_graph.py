"""No import circles over every package's ``src`` (issue #61): no module imports, directly or through others,
a module that imports it back. The graph is read from the source (AST), so an import hidden inside a function,
under ``if TYPE_CHECKING:`` or written relative counts like a top-level one."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from typing import cast

PACKAGES = Path(__file__).resolve().parents[2]


def _modules(roots: Iterable[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under each ``src`` root (a package is its ``__init__``)."""
    found: dict[str, Path] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, modules: dict[str, Path]
) -> list[str]:
    """The dotted names one import statement loads (relative imports resolved against ``name``): ``from a
    import b`` loads ``a.b`` when that is a module, else ``a``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _dynamic(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return called == "import_module" and isinstance(node.args[0].value, str)


def import_graph(roots: Iterable[Path]) -> dict[str, set[str]]:
    """Module -> the modules (of the same roots) it imports anywhere in its file (``importlib.import_module`` of
    a literal name included); an unknown dotted name
    falls back to its longest known prefix (``import a.b.c`` with ``c`` a function loads ``a.b``)."""
    modules = _modules(roots)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets = _targets(node, name, is_pkg, modules)
            elif _dynamic(node):  # importlib.import_module("a.b") with a literal name
                targets = [cast(ast.Constant, cast(ast.Call, node).args[0]).value]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles in each strongly connected component of more than one module (Tarjan): a shortest closed
    path through each of its modules, repeats dropped."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            components.append(component | {v})

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles: dict[frozenset[str], list[str]] = {}
    for comp in components:
        for start in sorted(comp) if len(comp) > 1 else ():
            path = _path(graph, comp, start)
            cycles.setdefault(frozenset(path), path)
    return list(cycles.values())


def _path(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest closed path from ``start`` back to it (breadth-first inside its component)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"not a cycle: {sorted(component)}")


def test_no_import_cycles_over_every_package() -> None:
    roots = sorted(PACKAGES.glob("*/src"))
    assert len(roots) >= 6, f"expected every package's src under {PACKAGES}, found {roots}"
    graph = import_graph(roots)
    assert graph.get("composer_core.loss.compose"), "the walk found no import in compose.py"
    cycles = import_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_finds_a_circle_hidden_in_a_function_and_a_relative_import(tmp_path: Path) -> None:
    """The check can fail: a synthetic package whose circle runs through a function-level import, a relative
    ``from . import`` and a package ``__init__``."""
    pkg = tmp_path / "src" / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import g\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import os\nif True:\n    from pkg import a\n")
    (pkg / "leaf.py").write_text("from pkg.c import nothing\n")
    (pkg / "dyn.py").write_text("import importlib\nimportlib.import_module('pkg.leaf')\n")
    graph = import_graph([tmp_path / "src"])
    assert (
        graph["pkg.sub"] == {"pkg.sub.b"}
        and graph["pkg.leaf"] == {"pkg.c"}
        and graph["pkg.dyn"] == {"pkg.leaf"}
    )
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    (pkg / "c.py").write_text("import os\n")
    assert import_cycles(import_graph([tmp_path / "src"])) == []
