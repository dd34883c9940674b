"""The package's import graph: no circles, nothing below the strategy imports it, the options at the bottom, and
the parallel subpackages entered through their ``__init__``.

What is guarded against the strategy (``lightning_mgpu.strategy``, the Lightning face): the layers it is built on,
``LOWER`` below (the parallelisms, checkpoints, precision, the planner that the Trainer calls at build time for
``"auto"`` sizes, launch, monitor, layout and its checks, options, the backends, the shims, ...) never import it,
at module level or in a function. What legitimately sits above and drives it is left out: ``cli/``,
``rehearsal/`` (``plan --rehearse`` plays ranks through ``strategy.setup`` and ``strategy.step``) and the demo.
A planted import checks that the guard sees such edges (``test_a_planted_upward_import_is_reported``).

Built with ``ast`` from every import statement, function-level and ``TYPE_CHECKING`` ones included (a deferred
import is still a dependency). Importing ``a.b.c`` also depends on the packages ``a.b`` (their ``__init__`` runs
first). The top-level ``lightning_mgpu/__init__`` loads each public name from its module on first use: ``from
lightning_mgpu import HybridStrategy`` is an import of ``lightning_mgpu.strategy``, other names of it none.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Collection
from pathlib import Path

import lightning_mgpu

PACKAGE = Path(lightning_mgpu.__file__).parent
ROOT = "lightning_mgpu"
# The upper layer: the Lightning face. (Its options are plain data at the bottom, which every layer may import.)
UPPER = ("lightning_mgpu.strategy",)  # the package: its modules import it too
# What sits below it and must not reach up into it (each a module or a package with everything in it).
LOWER = (
    "lightning_mgpu._compat",
    "lightning_mgpu.backends",
    "lightning_mgpu.checkpoint",
    "lightning_mgpu.extras",
    "lightning_mgpu.gpus",
    "lightning_mgpu.launch",
    "lightning_mgpu.layout",
    "lightning_mgpu.layout_checks",
    "lightning_mgpu.monitor",
    "lightning_mgpu.options",
    "lightning_mgpu.parallel",
    "lightning_mgpu.patches",
    "lightning_mgpu.planner",
    "lightning_mgpu.precision",
)
# The top-level package's public names and the modules that define them (loaded lazily, PEP 562).
EXPORTS: dict[str, str] = lightning_mgpu._EXPORTS


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(source: str, name: str, modules: Collection[str], is_package: bool = False) -> dict[str, int]:
    """``{imported module: line}`` of the module ``name`` whose code is ``source``: every import statement in it,
    the packages above each imported module included; ``modules`` are the package's module names."""

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    package = name if is_package else name.rpartition(".")[0]
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(source, name)):
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
            if target.startswith(ROOT + ".") and target.count(".") == 1 and target[len(ROOT) + 1 :] in EXPORTS:
                target = EXPORTS[target[len(ROOT) + 1 :]]  # a public name: the module that defines it
            found = resolve(target) if target.startswith(ROOT + ".") else None
            while found and found != ROOT:  # the module and the packages above it
                if found != name and not name.startswith(found + "."):
                    edges.setdefault(found, node.lineno)
                found = found.rpartition(".")[0]
    return edges


@functools.cache  # built once for the tests (it parses every file of the package); not to be mutated
def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` within the package."""
    modules = _modules()
    return {
        name: imports_of(path.read_text(), name, modules, is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }


def _where(source: str, line: int) -> str:
    path = _modules().get(source)
    return f"{path.relative_to(PACKAGE.parent) if path else source}:{line}"


def _below(name: str, lower: tuple[str, ...]) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in lower)


def _upward(graph: dict[str, dict[str, int]], lower: tuple[str, ...] = LOWER) -> list[str]:
    """The edges from a module of ``lower`` up into the strategy, each with the line importing it."""
    return [
        f"{source} -> {target} ({_where(source, line)})"
        for source, targets in graph.items()
        if _below(source, lower)
        for target, line in targets.items()
        if target in UPPER
    ]


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
    return [f"{a} -> {b} ({_where(a, line)})" for a in members for b, line in graph[a].items() if b in members]


def test_no_import_circles():
    graph = import_graph()
    circles = _circles(graph)
    assert not circles, "Import circles (each edge with the line importing it):\n" + "\n\n".join(
        "\n".join(_edges_within(graph, circle)) for circle in circles
    )


def test_nothing_below_the_strategy_imports_it():
    upward = _upward(import_graph())
    assert not upward, "Imports from below the strategy (LOWER) up into it:\n" + "\n".join(upward)


def test_a_planted_upward_import_is_reported():
    """Not vacuous: an edge from the planner up into the strategy, planted in a copy of the graph or written in a
    module's source (in a function, in ``TYPE_CHECKING``, relative, or a public name of the top-level package),
    is reported; so is the rehearsal's real function-level import, were the rehearsal counted below."""
    before = set(_upward(import_graph()))  # empty (the test above), but this test checks the planting only
    graph = {source: dict(targets) for source, targets in import_graph().items()}
    graph["lightning_mgpu.planner.cost"]["lightning_mgpu.strategy"] = 1
    assert set(_upward(graph)) - before == {
        "lightning_mgpu.planner.cost -> lightning_mgpu.strategy (lightning_mgpu/planner/cost.py:1)"
    }

    modules = _modules()
    snippets = {
        "def later():\n    from lightning_mgpu.strategy import x\n": 2,
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_mgpu.strategy.setup import y\n": 3,
        "def later():\n    from ..strategy.step import run_step\n": 2,
        "def later():\n    from lightning_mgpu import ParallelLayout, HybridStrategy\n": 2,
        "import lightning_mgpu.strategy.hybrid\n": 1,
    }
    for snippet, line in snippets.items():
        planted = {source: dict(targets) for source, targets in import_graph().items()}
        planted["lightning_mgpu.planner.cost"] = imports_of(snippet, "lightning_mgpu.planner.cost", modules)
        assert set(_upward(planted)) - before == {
            f"lightning_mgpu.planner.cost -> lightning_mgpu.strategy (lightning_mgpu/planner/cost.py:{line})"
        }, snippet
    assert imports_of(
        "from lightning_mgpu import ParallelLayout, __version__\n", "lightning_mgpu.planner.cost", modules
    ) == {"lightning_mgpu.layout": 1}  # a public name is its own module's import, nothing more
    assert "lightning_mgpu.strategy" in import_graph()["lightning_mgpu.rehearsal.step"]  # in _step
    assert _upward(import_graph(), (*LOWER, "lightning_mgpu.rehearsal"))


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
        f"{source} -> {target} ({_where(source, line)})"
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
