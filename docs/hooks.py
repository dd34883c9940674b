"""mkdocs hooks: pages rendered from the code itself, so that they cannot drift.

- A line ``<!-- cli: demo -->`` becomes the ``--help`` of ``lightning-mgpu demo`` (``<!-- cli: -->`` the top
  level), as a text block.
- A line ``<!-- refusals -->`` becomes the table of every refusal of what this version does not implement: each
  ``raise NotImplementedError(...)`` and ``refuse_compositions(...)`` in the package, read from its source
  (:func:`refusals`; ``tests/test_docs.py`` checks that it finds every one a plain search does).
- Before a build, the figures ``docs/figures.py`` writes are checked against what it would write now (a figure
  made from data the code no longer produces fails the build; ``python docs/figures.py`` rewrites them).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

_CLI_MARKER = re.compile(r"^<!-- cli: ?([\w-]*) -->$", re.MULTILINE)
_REFUSALS_MARKER = "<!-- refusals -->"
DOCS = Path(__file__).resolve().parent
PACKAGE = DOCS.parent / "lightning_mgpu"


def _help(command: str) -> str:
    from lightning_mgpu.cli import build_parser

    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal's width: the same text on every machine
    parser = build_parser()
    if not command:
        return parser.format_help()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return subparsers.choices[command].format_help()  # type: ignore[attr-defined]


class Refusal(NamedTuple):
    where: str  # the module, relative to the package (``parallel/context/runtime.py``)
    line: int
    message: str  # the message, each formatted value shown as ``{expression}``


def _text(node: ast.expr) -> str:
    """A message's source as its words: literal parts as they are, formatted values as ``{expression}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(part) for part in node.values)
    if isinstance(node, ast.FormattedValue):
        return "{" + ast.unparse(node.value) + "}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return "{" + ast.unparse(node) + "}"


def _refusal(node: ast.AST) -> str | None:
    """The message of ``raise NotImplementedError(...)`` or of a ``refuse_compositions(subject, {...}, why)``."""
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        call = node.exc
        if isinstance(call.func, ast.Name) and call.func.id == "NotImplementedError" and call.args:
            return _text(call.args[0])
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "refuse_compositions" and len(node.args) == 3:
        subject, combinations, why = node.args
        named = (
            [_text(key) for key in combinations.keys if key is not None] if isinstance(combinations, ast.Dict) else []
        )
        return f"{_text(subject)} does not compose with {' or '.join(named)} yet: {_text(why)}"
    return None


# Functions that raise for their callers (each call is listed instead), or a list of pending options (empty now).
_RAISE_FOR_CALLERS = ("refuse_compositions", "check_implemented")


def refusals() -> list[Refusal]:
    """Every refusal of an unimplemented feature or composition in the package, in file and line order."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skipped = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef) and function.name in _RAISE_FOR_CALLERS
            for node in ast.walk(function)
        }
        for node in ast.walk(tree):
            message = None if id(node) in skipped else _refusal(node)
            if message is not None:
                found.append(Refusal(str(path.relative_to(PACKAGE)), node.lineno, " ".join(message.split())))
    return sorted(found, key=lambda refusal: (refusal.where, refusal.line))


def _refusals_table() -> str:
    rows = ["| where | what is refused, and what to do instead |", "| --- | --- |"]
    for refusal in refusals():
        message = refusal.message.replace("|", "\\|")
        rows.append(f"| `{refusal.where}` | {message} |")
    return "\n".join(rows)


def _figures() -> Any:
    spec = importlib.util.spec_from_file_location("docs_figures", DOCS / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_figures", module)
    spec.loader.exec_module(module)
    return module


def on_pre_build(**_: Any) -> None:
    from mkdocs.exceptions import PluginError

    stale = _figures().stale()
    if stale:
        raise PluginError(
            f"docs/figures: {', '.join(stale)} differ from what the code draws: run python docs/figures.py"
        )


def on_page_markdown(markdown: str, **_: Any) -> str:
    markdown = _CLI_MARKER.sub(lambda m: f"```text\n{_help(m.group(1)).rstrip()}\n```", markdown)
    if _REFUSALS_MARKER in markdown:
        markdown = markdown.replace(_REFUSALS_MARKER, _refusals_table())
    return markdown
