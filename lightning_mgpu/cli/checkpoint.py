"""``lightning-mgpu consolidate`` and ``inspect``: a sharded checkpoint as one file, and what a checkpoint holds."""

from __future__ import annotations

import argparse


def add_checkpoint_parsers(subparsers: argparse._SubParsersAction) -> None:
    consolidate = subparsers.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one file (torch or safetensors), in one process",
        description="Write a sharded HybridStrategy checkpoint (a DCP directory, any layout) as one file with the"
        " plain module's keys: a Lightning checkpoint loadable with `LightningModule.load_from_checkpoint` and"
        " `torch.load(weights_only=True)`, or safetensors weights (Hugging Face names for a Hugging Face model).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    consolidate.add_argument("checkpoint", metavar="CKPT_DIR", help="the sharded checkpoint directory")
    consolidate.add_argument("out", metavar="OUT", help="the file to write")
    consolidate.add_argument("--format", choices=("torch", "safetensors"), default="torch", dest="out_format")
    consolidate.add_argument(
        "--weights-only",
        action="store_true",
        help="torch format: keep the weights and hyperparameters only (no optimizer, loops)",
    )
    consolidate.add_argument(
        "--prefix",
        default="auto",
        help="safetensors: key prefix to strip; 'auto' = the LightningModule attribute holding"
        " the Hugging Face model (or 'model.' when every key has it), 'none' = keep keys",
    )
    consolidate.add_argument(
        "--trust",
        action="store_true",
        help="unpickle arbitrary objects in the checkpoint's metadata (weights_only=False)",
    )
    consolidate.set_defaults(run=_run_consolidate)

    inspect = subparsers.add_parser(
        "inspect",
        help="print a checkpoint's layout, step and tensor shapes",
        description="Print the layout a checkpoint was saved with, its epoch and step, and its tensors' shapes.",
    )
    inspect.add_argument("checkpoint", metavar="CKPT", help="a sharded checkpoint directory or a full file")
    inspect.add_argument("--optimizer", action="store_true", help="list the optimizer state tensors too")
    inspect.add_argument(
        "--trust",
        action="store_true",
        help="unpickle arbitrary objects in the checkpoint's metadata (weights_only=False)",
    )
    inspect.set_defaults(run=_run_inspect)


def _run_consolidate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lightning_mgpu.checkpoint import write_consolidated

    print(
        write_consolidated(
            Path(args.checkpoint),
            Path(args.out),
            args.out_format,
            args.weights_only,
            args.prefix,
            load_weights_only=False if args.trust else True,
        )
    )
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lightning_mgpu.checkpoint import describe

    print(describe(Path(args.checkpoint), args.optimizer, load_weights_only=False if args.trust else True))
    return 0
