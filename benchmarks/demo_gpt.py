"""The command line the scripts share (flags, checks, ``--only``, imports before forking) and the demo GPT as every
benchmark runs it: its seeded module and its data in Lightning's order."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Iterable
from typing import Any

from benchmarks.run import SEED


def add_run_args(
    parser: argparse.ArgumentParser,
    steps: int = 20,
    warmup: int = 3,
    repeats: int = 3,
    block_size: int = 64,
    n_embd: int | None = 192,
    batch_help: str = "per rank",
) -> None:
    """The flags the scripts on the demo GPT share: steps, warm-up, repeats, model sizes, batch, timeout, verbose."""
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=warmup, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved runs per configuration")
    parser.add_argument("--n-layer", type=int, default=4)
    if n_embd is not None:
        parser.add_argument("--n-embd", type=int, default=n_embd)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=block_size)
    parser.add_argument("--batch-size", type=int, default=8, help=batch_help)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and torch's messages")


def gpt_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """The demo ``GPTLightningModule``'s sizes from the flags, with the seeded init every run shares."""
    return dict(
        block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"], seed=SEED
    )


def demo_data(args: dict[str, Any], batch_size: int | None = None) -> Any:
    from lightning_mgpu.demo import TextDataModule

    return TextDataModule(batch_size=batch_size or args["batch_size"], block_size=args["block_size"], val_fraction=0.1)


def lightning_order(dataset: Any, batch_size: int, replicas: int | None = None, rank: int | None = None) -> Any:
    """A loader of the batches a Trainer feeds this rank: Lightning's ``DistributedSampler(shuffle=True)``, seeded
    as it seeds it (``PL_GLOBAL_SEED``), over ``replicas`` data-parallel ranks (default: the world)."""
    from torch.utils.data import DataLoader, DistributedSampler

    seed = int(os.getenv("PL_GLOBAL_SEED", 0))
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def parse_run_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> dict[str, Any]:
    """Parsed flags as a dict, checked: 0 <= --warmup (and --mem-step) < --steps, --repeats >= 1."""
    ns = parser.parse_args(argv)
    if not 0 <= ns.warmup < ns.steps or not 0 <= getattr(ns, "mem_step", 0) < ns.steps or ns.repeats < 1:
        parser.error("need 0 <= --warmup < --steps, 0 <= --mem-step < --steps and --repeats >= 1")
    return vars(ns)


def select(parser: argparse.ArgumentParser, only: str, choices: Iterable[str]) -> list[str]:
    """The configurations named in ``--only`` (comma-separated; all when empty), checked against ``choices``."""
    choices = list(choices)
    names = [name.strip() for name in only.split(",") if name.strip()] or choices
    if set(names) - set(choices):
        parser.error(f"unknown configurations {sorted(set(names) - set(choices))}; choose from {choices}")
    return names


def preload(*modules: str) -> None:
    """Import what the ranks need before forking them, so that each job starts in ~1 s."""
    for module in ("lightning", "lightning_mgpu", "lightning_mgpu.demo", *modules):
        importlib.import_module(module)
