"""mkdocs hook: the command reference is rendered from the argparse parser itself, so it cannot drift.

A page line ``<!-- cli: demo -->`` becomes the ``--help`` of ``lightning-mgpu demo`` (``<!-- cli: -->`` the top
level), as a text block.
"""

from __future__ import annotations

import os
import re
from typing import Any

_MARKER = re.compile(r"^<!-- cli: ?([\w-]*) -->$", re.MULTILINE)


def _help(command: str) -> str:
    from lightning_mgpu.cli import build_parser

    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal's width: the same text on every machine
    parser = build_parser()
    if not command:
        return parser.format_help()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return subparsers.choices[command].format_help()  # type: ignore[attr-defined]


def on_page_markdown(markdown: str, **_: Any) -> str:
    return _MARKER.sub(lambda m: f"```text\n{_help(m.group(1)).rstrip()}\n```", markdown)
