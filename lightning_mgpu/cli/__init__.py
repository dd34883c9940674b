"""The ``lightning-mgpu`` command: one module per command group (demo, checkpoint, plan, bench), assembled here.

Only the command being run has its module imported (its options and its work need torch or the planner), so that
``--help``, ``--version`` and a mistyped command answer without importing torch or Lightning. A user error ends in
one line naming the value and the fix (``errors.py``): exit status 2 for a usage error, 1 for a missing package or a
damaged checkpoint; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from lightning_mgpu.cli.errors import HelpFormatter, exit_status

__all__ = ["build_parser", "main"]

# command: (module under lightning_mgpu.cli, the function adding its options, the one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": (
        "demo",
        "add_demo_arguments",
        "train a small GPT on bundled Shakespeare sonnets with several CPU processes",
    ),
    "consolidate": (
        "checkpoint",
        "add_consolidate_arguments",
        "write a sharded checkpoint as one file (torch or safetensors), in one process",
    ),
    "inspect": ("checkpoint", "add_inspect_arguments", "print a checkpoint's layout, step and tensor shapes"),
    "plan": (
        "plan",
        "add_plan_arguments",
        "predict memory per GPU and speed of every layout for a model on a cluster, ranked; print the best as a"
        " HybridStrategy(...) call",
    ),
    "bench": ("bench", "add_bench_arguments", "measure every valid layout of a model on this machine and rank them"),
}
_DEBUG_HELP = "show an error's traceback instead of its one-line message"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``lightning-mgpu`` command line (the docs' command reference is rendered from it). With ``command``, only
    that command's options are added (the others keep their name and help line), importing only its module."""
    from lightning_mgpu import __version__

    parser = argparse.ArgumentParser(
        prog="lightning-mgpu",
        description="Tensor, pipeline, context and data parallelism with ZeRO for PyTorch Lightning.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lightning-mgpu {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    for name, (module, adder, help_line) in _COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_line, description=help_line[:1].upper() + help_line[1:] + ".")
        sub.formatter_class = HelpFormatter
        if command is None or command == name:
            getattr(importlib.import_module(f"lightning_mgpu.cli.{module}"), adder)(sub)
            sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not an option), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Run ``lightning-mgpu`` with ``argv`` (default: the process's arguments); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(argv)
    parser = build_parser(command if command in _COMMANDS else "")
    try:
        if command is not None and command not in _COMMANDS:
            close = difflib.get_close_matches(command, _COMMANDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            parser.error(f"unknown command {command!r}: {hint}The commands are {', '.join(_COMMANDS)}.")
        args = parser.parse_args(argv)
    except SystemExit as exit:  # argparse: --help and --version exit 0; a usage error printed its line, exits 2
        return exit.code if isinstance(exit.code, int) else 2
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"lightning-mgpu {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if args.debug:
            raise
        status, message = exit_status(error)
        print(f"lightning-mgpu {command}: error: {message}", file=sys.stderr)
        return status
