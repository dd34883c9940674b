"""The package's import graph: no circles, nothing below the strategy imports it, the options at the bottom, and
the parallel subpackages entered through their ``__init__``.

Built with ``ast`` from every import statement, function-level and ``TYPE_CHECKING`` ones included (a deferred
import is still a dependency). Importing ``a.b.c`` also depends on the packages ``a.b`` (their ``__init__`` runs
first); the top-level ``lightning_mgpu/__init__`` (public names only) is left out.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import lightning_mgpu

PACKAGE = Path(lightning_mgpu.__file__).parent
ROOT = "lightning_mgpu"
# The upper layer: the Lightning face. (Its options are plain data at the bottom, which every layer may import.)
UPPER = ("lightning_mgpu.strategy",)  # the package: its modules import it too
# What sits below it and must not reach up into it.
LOWER = ("lightning_mgpu.parallel", "lightning_mgpu.checkpoint", "lightning_mgpu.precision")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


@functools.cache  # built once for the three tests (it parses every file of the package); not to be mutated
def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` within the package."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith(ROOT + ".") else None
                while found and found != ROOT:  # the module and the packages above it
                    if found != name and not name.startswith(found + "."):
                        graph[name].setdefault(found, node.lineno)
                    found = found.rpartition(".")[0]
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in graph:
        if node not in index:
            visit(node)
    return found


def _edges_within(graph: dict[str, dict[str, int]], members: list[str]) -> list[str]:
    return [
        f"{a} -> {b} ({_modules()[a].relative_to(PACKAGE.parent)}:{line})"
        for a in members
        for b, line in graph[a].items()
        if b in members
    ]


def test_no_import_circles():
    graph = import_graph()
    circles = _circles(graph)
    assert not circles, "Import circles (each edge with the line importing it):\n" + "\n\n".join(
        "\n".join(_edges_within(graph, circle)) for circle in circles
    )


def test_nothing_below_the_strategy_imports_it():
    graph = import_graph()
    upward = [
        f"{source} -> {target} ({_modules()[source].relative_to(PACKAGE.parent)}:{line})"
        for source, targets in graph.items()
        if source.startswith(LOWER)
        for target, line in targets.items()
        if target in UPPER
    ]
    assert not upward, "Imports from parallel/, checkpoint/ or precision.py up into the strategy:\n" + "\n".join(upward)


def test_the_graph_sees_deferred_and_relative_imports():
    """Not vacuous: a function-level import and a TYPE_CHECKING import are edges."""
    graph = import_graph()
    assert "lightning_mgpu.checkpoint.convert" in graph["lightning_mgpu.checkpoint.checkpointer"]  # in a function
    assert "lightning_mgpu.strategy" in graph["lightning_mgpu"] or graph["lightning_mgpu"]
    assert _circles({"a": {"b": 1}, "b": {"a": 2}, "c": {"a": 3}}) == [["a", "b"]]


SUBPACKAGES = tuple(
    f"{ROOT}.parallel.{path.name}"
    for path in sorted((PACKAGE / "parallel").iterdir())
    if (path / "__init__.py").exists()
)


def test_parallel_subpackages_are_entered_through_their_init():
    """Code outside ``parallel/tensor``, ``pipeline``, ``data`` or ``experts`` imports what the subpackage's
    ``__init__`` exports, never one of its inner modules: the entry points are the ``__init__``'s names."""
    assert {"tensor", "pipeline", "data", "experts"} <= {name.rpartition(".")[2] for name in SUBPACKAGES}
    graph = import_graph()
    inward = [
        f"{source} -> {target} ({_modules()[source].relative_to(PACKAGE.parent)}:{line})"
        for source, targets in graph.items()
        for target, line in targets.items()
        for package in SUBPACKAGES
        if target.startswith(package + ".") and not (source == package or source.startswith(package + "."))
    ]
    assert not inward, "Imports of a parallel subpackage's inner modules from outside it:\n" + "\n".join(inward)


def test_the_options_are_a_bottom_layer():
    """``options.py`` is plain typed data: it imports nothing of the package, so every layer can take a
    ``ParallelOptions`` (each parallelism checks its own options in its ``check``)."""
    assert import_graph()["lightning_mgpu.options"] == {}
    assert "lightning_mgpu.options" in import_graph()["lightning_mgpu.parallel.pipeline.checks"]


def test_checkpoint_and_parallel_in_one_direction():
    """``checkpoint/`` may use ``parallel/`` (the experts a rank holds), never the reverse; the DeepSpeed backend,
    which needs both, sits above them in ``backends/``."""
    graph = import_graph()
    back = [
        f"{source} -> {target}"
        for source, targets in graph.items()
        if source.startswith(f"{ROOT}.parallel")
        for target in targets
        if target.startswith((f"{ROOT}.checkpoint", f"{ROOT}.backends"))
    ]
    assert not back, "parallel/ imports checkpoint/ or backends/:\n" + "\n".join(back)
