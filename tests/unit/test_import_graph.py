"""The house plan, checked on the source (issue 17; DESIGN.md "Data flow"): imports point down the layers and no
two files import each other, directly or round a circle — lazy imports inside functions included, since a lazy
import is how a circle usually hides.

The graph is read from the source with ``ast`` (nothing is imported), so the test sees every ``import`` statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("var_core", "profilers", "ablations", "sweeps", "studies")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (``from pkg import name`` counts as the
    submodule ``pkg.name`` when that is a module)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_two_files_import_each_other():
    assert _circles(_imports(_modules())) == []


def test_imports_point_down_the_layers():
    graph = _imports(_modules())
    upward = []
    for module, targets in graph.items():
        for target in targets:
            if module.startswith("var_core.models") and target.startswith("var_core.engine"):
                upward.append((module, target))  # models know neither the loop nor any method
            if module.startswith("var_core") and target.split(".")[0] in ("ablations", "sweeps", "studies",
                                                                            "profilers"):
                upward.append((module, target))
            if module.split(".")[0] in ("ablations", "sweeps", "profilers") and target.startswith("studies"):
                upward.append((module, target))
    assert sorted(upward) == []


def test_the_zoo_sits_above_models_and_engine():
    graph = _imports(_modules())
    assert "var_core.zoo" in graph and not (REPO / "var_core" / "models" / "zoo.py").exists()
    assert any(t.startswith("var_core.engine") for t in graph["var_core.zoo"])
    assert any(t.startswith("var_core.models") for t in graph["var_core.zoo"])
