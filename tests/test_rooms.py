"""Rooms stay small and imports run one way, in the package and in the benchmarks: no module
over 500 lines, no function over 60, and no import cycle at any depth (imports under
``TYPE_CHECKING`` and inside functions count)."""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("gradientmail", "benchmarks")
MODULE_LINES = 500
FUNCTION_LINES = 60


def _sources() -> dict[str, Path]:
    """Every module of the checked trees by its dotted name (a package by its own name)."""
    modules = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


SOURCES = _sources()


def _imported(name: str, path: Path) -> Iterator[str]:
    """The checked modules ``name`` imports. ``from package import module`` is an import of
    the module; a benchmark's bare ``import bench_x`` (the scripts run from their folder) is
    an import of ``benchmarks.bench_x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in SOURCES else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if name.startswith("benchmarks.") and f"benchmarks.{target}" in SOURCES:
                target = f"benchmarks.{target}"
            if target in SOURCES and target != name:
                yield target


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
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
            elif successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(graph[successor]))))
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
    return found


def test_no_module_is_over_its_size() -> None:
    long = {
        name: lines
        for name, path in SOURCES.items()
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_its_size() -> None:
    long = {}
    for name, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long[f"{name}.{node.name}:{node.lineno}"] = lines
    assert long == {}


def test_no_import_cycle() -> None:
    graph = {name: set(_imported(name, path)) for name, path in SOURCES.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(
    graph: dict[str, set[str]], expected: list[list[str]]
) -> None:
    assert sorted(_cycles(graph)) == expected
