"""The ``lightning-mgpu`` command: one module per command group (demo, checkpoint, plan, bench), assembled here."""

from __future__ import annotations

import argparse
import sys

from lightning_mgpu.cli.bench import add_bench_parser
from lightning_mgpu.cli.checkpoint import add_checkpoint_parsers
from lightning_mgpu.cli.demo import add_demo_parser
from lightning_mgpu.cli.plan import add_plan_parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-mgpu`` command line (the docs' command reference is rendered from it)."""
    from lightning_mgpu import __version__

    parser = argparse.ArgumentParser(
        prog="lightning-mgpu",
        description="Tensor, pipeline, context and data parallelism with ZeRO for PyTorch Lightning.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-mgpu {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    add_demo_parser(subparsers)
    add_checkpoint_parsers(subparsers)
    add_plan_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
    from lightning_mgpu.checkpoint import CheckpointError

    try:
        return args.run(args)
    except (CheckpointError, FileNotFoundError) as error:  # a damaged or missing checkpoint: the message says it all
        print(f"lightning-mgpu: error: {error}", file=sys.stderr)
        return 1
