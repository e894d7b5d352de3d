"""The package's shape: no import circles among its modules, and no module over 700 lines.

Imports are read statically (ast), so every one counts, including the lazy ones inside functions: a
lazy import hides a circle from Python, not from a reader following the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "torchrec_cloud"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name: (file, whether it is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def _owner(name: str, modules: dict) -> str | None:
    """The package's module a dotted name lives in (``a.b.func`` -> ``a.b``), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Which of the package's modules each module imports (itself excluded)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # ``from pkg import mod`` imports the module pkg.mod; ``from mod import f``, mod.
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                owner = _owner(target, modules)
                if owner is not None and owner != name:
                    graph[name].add(owner)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: its strongly connected components of more than one module
    (Tarjan's algorithm, iterative), each as one circle through its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_circle(graph, set(c)) for c in components]


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One path from the component's first module back to itself, for the message."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                frontier.append(child)
    raise AssertionError("a strongly connected component always has a circle")


def test_the_finder_sees_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_holds_imports_inside_functions():
    # data/__init__.py imports the reader only inside build_data_source.
    assert "torchrec_cloud.data.reader" in import_graph()["torchrec_cloud.data"]


def test_no_import_circles():
    circles = import_circles(import_graph())
    assert not circles, "import circles (make the imports point one way: move the shared piece to the lower module):\n" + "\n".join(
        " -> ".join(c) for c in circles
    )


MAX_MODULE_LINES = 700


def test_no_module_over_700_lines():
    # A module past this mixes concepts (config.py once held the tree, the presets and the
    # flags in 784 lines): split it by concept, as config/ is.
    long = {str(p.relative_to(SRC)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
