"""One rank of the restart soak (``benchmarks/soak_restarts.py``): ``examples/elastic/train.py`` with its faults.

Started by the soak's torchrun agents as ``-m benchmarks.soak_worker`` (and once as one plain process for the
reference, ``--reference``), with the example's own arguments after ``--``. Besides the example's training, each
rank

- records every optimizer step it takes as global rank 0 (``steps.jsonl``: step, time, world size), the soak's
  clock for recovery times and recomputed steps;
- fires the soak's active fault (``active.json``, written by the soak) when it is the rank the fault names: it
  claims the fault once (``fired-<id>.json``, created exclusively, so that a replayed step cannot fire it again),
  then stalls where the fault belongs (after an optimizer step, in the data loader's ``__getitem__``, inside a
  checkpoint's write or read) until the soak kills or stops it; a data-loader fault stalls for good by itself;
- stops at the step the soak names once its faults are done (``stop.json``, written steps ahead of every rank:
  each rank reads it after every optimizer step, so all stop after the same one);
- writes the trained weights (``final.pt``, global rank 0, after ``fit`` gave the module back plain).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lightning_mgpu.demo.data import TextDataset

REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 16  # the soak's global_batch_size (benchmarks/soak_restarts.py)
STALL_S = 3600.0  # "for good": the soak (or torchrun after it) ends the process long before


def _example() -> Any:
    """``examples/elastic/train.py`` as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("elastic_train", REPO / "examples" / "elastic" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


class Soak(L.Callback):
    """The soak's side in one rank: its steps recorded, its faults fired, its final weights written."""

    def __init__(self, directory: Path, every_n_steps: int) -> None:
        self.directory, self.every = directory, every_n_steps
        self.node = os.environ.get("SOAK_NODE", "-")
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.trainer: L.Trainer | None = None
        self._stall_next_fetch: dict[str, Any] | None = None
        self._patch()

    # ------------------------------------------------------------------------------------------------- faults
    def _active(self, kinds: tuple[str, ...]) -> dict[str, Any] | None:
        """The active fault if it is one of ``kinds`` and names this rank (and its world size), else None."""
        try:
            fault = json.loads((self.directory / "active.json").read_text())
        except (OSError, ValueError):
            return None
        world = self.trainer.world_size if self.trainer is not None else None
        if fault.get("kind") not in kinds or fault.get("node") != self.node:
            return None
        if fault.get("local_rank") != self.local_rank or fault.get("world") not in (None, world):
            return None
        return fault

    def _claim(self, fault: dict[str, Any], where: str) -> bool:
        """Fire ``fault`` at most once in the whole job: the first rank to create its file owns it."""
        step = self.trainer.global_step if self.trainer is not None else None
        record = {"pid": os.getpid(), "time": time.time(), "where": where, "step": step}
        try:
            with open(self.directory / f"fired-{fault['id']}.json", "x") as file:
                file.write(json.dumps(record))
        except FileExistsError:
            return False
        print(f"soak: fault {fault['id']} ({fault['kind']}) fired in pid {os.getpid()} {where}", flush=True)
        return True

    def _stall_if(self, kinds: tuple[str, ...], where: str, ready: Callable[[dict[str, Any]], bool]) -> None:
        fault = self._active(kinds)
        if fault is not None and ready(fault) and self._claim(fault, where):
            time.sleep(STALL_S)

    def _past_from_step(self, fault: dict[str, Any]) -> bool:
        """Past the step the soak asked for: the job moved on (a checkpoint later) since the last fault."""
        return self.trainer is not None and self.trainer.global_step >= fault.get("from_step", 0)

    def _mid_interval(self, fault: dict[str, Any]) -> bool:
        """Between two checkpoints (steps are lost), past the soak's step."""
        return (
            self._past_from_step(fault)
            and self.trainer is not None
            and self.trainer.global_step % self.every == (self.every // 2)
        )

    def _patch(self) -> None:
        """Stalls inside the data loader and inside a checkpoint's write and read (this process only)."""
        soak = self
        fetch, write, read = TextDataset.__getitem__, FileSystemWriter.write_data, FileSystemReader.read_data
        length = TextDataset.__len__

        def whole_global_batches(dataset: TextDataset) -> int:
            # Epochs of whole global batches: the soak crosses epochs, and an epoch's last partial batch is padded
            # by the DistributedSampler to the world size (as under DDP), so at dp 2 and dp 4 it would hold other
            # samples than one process's: that step could match no reference.
            return length(dataset) // GLOBAL_BATCH * GLOBAL_BATCH

        def getitem(dataset: TextDataset, index: int) -> Any:
            fault, soak._stall_next_fetch = soak._stall_next_fetch, None
            if fault is not None and soak._claim(fault, "in the data loader's __getitem__"):
                time.sleep(STALL_S)
            return fetch(dataset, index)

        def write_data(writer: FileSystemWriter, plan: Any, planner: Any) -> Any:
            future = write(writer, plan, planner)
            if ".last.ckpt" in str(writer.path):  # last.ckpt's save: `ckpt_path="last"` reads the previous one
                soak._stall_if(("kill-in-save",), f"writing {Path(writer.path).name}", soak._past_from_step)
            return future

        def read_data(reader: FileSystemReader, plan: Any, planner: Any) -> Any:
            soak._stall_if(("kill-in-load",), f"reading {Path(str(reader.path)).name}", lambda fault: True)
            return read(reader, plan, planner)

        TextDataset.__getitem__ = getitem  # type: ignore[method-assign]
        TextDataset.__len__ = whole_global_batches  # type: ignore[method-assign]
        FileSystemWriter.write_data = write_data  # type: ignore[method-assign, assignment]
        FileSystemReader.read_data = read_data  # type: ignore[method-assign, assignment]

    # -------------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.trainer = trainer

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # not an optimizer step
        if trainer.global_rank == 0:
            record = {"step": trainer.global_step - 1, "time": time.time(), "world": trainer.world_size}
            _append(self.directory / "steps.jsonl", record | {"pid": os.getpid()})
        if trainer.global_step >= self._stop_at():
            trainer.should_stop = True  # every rank at the same step: the soak wrote it steps ahead of them all
        self._stall_if(("kill-worker", "stop-worker", "kill-node"), "after an optimizer step", self._mid_interval)
        fault = self._active(("stall-loader",))
        if fault is not None and self._mid_interval(fault):
            self._stall_next_fetch = fault  # the next sample this rank's loader fetches

    def _stop_at(self) -> float:
        """The step the soak ends the job at, once its faults are done (the reference then trains as many)."""
        try:
            return float(json.loads((self.directory / "stop.json").read_text())["at"])
        except (OSError, ValueError, KeyError):
            return float("inf")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:  # the module is plain again (restore_module_on_teardown): its full weights
            torch.save({k: v.detach().cpu() for k, v in pl_module.state_dict().items()}, self.directory / "final.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak-dir", type=Path, required=True, help="the soak's control and record directory")
    parser.add_argument("--every-n-steps", type=int, required=True, help="the example's checkpoint interval")
    args, example_args = parser.parse_known_args(argv)
    example_args = [a for a in example_args if a != "--"]
    soak = Soak(args.soak_dir, args.every_n_steps)
    _example().main([*example_args, "--every-n-steps", str(args.every_n_steps)], extra_callbacks=(soak,))


if __name__ == "__main__":
    main(sys.argv[1:])
