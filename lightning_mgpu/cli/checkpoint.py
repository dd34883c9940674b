"""``lightning-mgpu consolidate`` and ``inspect``: a sharded checkpoint as one file, and what a checkpoint holds."""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_mgpu.cli.errors import UsageError

_TRUST_HELP = "unpickle arbitrary objects in the checkpoint's metadata (weights_only=False): only for files you trust"


def add_consolidate_arguments(consolidate: argparse.ArgumentParser) -> None:
    consolidate.description = (
        "Write a sharded HybridStrategy checkpoint (a DCP directory, any layout) as one file with the plain module's"
        " keys: a Lightning checkpoint loadable with `LightningModule.load_from_checkpoint` and"
        " `torch.load(weights_only=True)`, or safetensors weights (Hugging Face names for a Hugging Face model)."
        " A missing parent directory of OUT is created."
    )
    consolidate.add_argument("checkpoint", metavar="CKPT_DIR", help="the sharded checkpoint directory (or a full file)")
    consolidate.add_argument("out", metavar="OUT", help="the file to write (not CKPT_DIR itself)")
    consolidate.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        default="torch",
        dest="out_format",
        help="torch: a Lightning checkpoint; safetensors: the weights (written without the safetensors package)",
    )
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
    consolidate.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    consolidate.set_defaults(run=_run_consolidate)


def add_inspect_arguments(inspect: argparse.ArgumentParser) -> None:
    inspect.description = "Print the layout a checkpoint was saved with, its epoch and step, and its tensors' shapes."
    inspect.add_argument("checkpoint", metavar="CKPT", help="a sharded checkpoint directory or a full file")
    inspect.add_argument("--optimizer", action="store_true", help="list the optimizer state tensors too")
    inspect.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    inspect.set_defaults(run=_run_inspect)


def _check_paths(source: Path, out: Path) -> None:
    """OUT may not be the checkpoint (or lie inside it), nor an existing directory: the write would replace or
    change what it reads."""
    if not source.exists():
        raise FileNotFoundError(f"Checkpoint {source} does not exist: give a sharded checkpoint directory or a file.")
    resolved_source, resolved_out = source.resolve(), out.resolve()
    if resolved_out == resolved_source:
        raise UsageError(f"OUT {out} is the checkpoint being read: give another path, e.g. {source.name}.ckpt.")
    if resolved_source.is_dir() and resolved_source in resolved_out.parents:
        raise UsageError(
            f"OUT {out} lies inside the checkpoint directory {source}: write it beside it, e.g."
            f" {source.parent / (source.name + '.ckpt')}."
        )
    if out.is_dir():
        raise UsageError(f"OUT {out} is a directory: give the file to write, e.g. {out / 'model.ckpt'}.")


def _run_consolidate(args: argparse.Namespace) -> int:
    source, out = Path(args.checkpoint), Path(args.out)
    _check_paths(source, out)
    from lightning_mgpu.checkpoint import write_consolidated

    created = not out.parent.exists()
    summary = write_consolidated(
        source, out, args.out_format, args.weights_only, args.prefix, load_weights_only=False if args.trust else True
    )
    print(summary + (f"; created the directory {out.parent}" if created else ""))
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from lightning_mgpu.checkpoint import describe

    print(describe(Path(args.checkpoint), args.optimizer, load_weights_only=False if args.trust else True))
    return 0
