"""Elastic training: a lost node does not end the run; the job resumes on the devices left.

The LightningModule (``lightning_mgpu.demo.GPTLightningModule``) is the single-device one. What makes the run
elastic is all in this script's Trainer:

- ``num_nodes`` is read from torchrun's variables, so each restart uses the nodes that came back;
- ``HybridStrategy(global_batch_size=N)`` keeps the samples per optimizer step when the data-parallel size changes
  (gradient accumulation makes up the difference), and ``"auto"`` sizes are planned again for the new world;
- ``ModelCheckpoint(every_n_train_steps=k, save_last=True)`` and ``fit(ckpt_path="last")``: a restart continues
  from the latest complete checkpoint, resharded to the new layout, and the interrupted epoch continues at its next
  unseen sample (the position is kept in samples, not in per-rank batches). Under SLURM, where the requeue signal
  (``--signal=SIGUSR1@90``) made Lightning save ``hpc_ckpt_<n>.ckpt`` after the last ``last.ckpt``, that one
  (``ckpt_path="hpc"``): Lightning's ``"last"`` looks at ``ModelCheckpoint``'s files only.

Started by ``torchrun.sh`` (torchrun's elastic agent: ``--nnodes=MIN:MAX --max-restarts=K``) or ``slurm.sbatch``
(``--requeue``) next to this file. ``--record-dir DIR`` writes each rank's micro-batches (step, sample ids, loss)
to ``DIR/rank<R>-pid<P>.jsonl`` (the test suite compares them with one uninterrupted process).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu import HybridStrategy
from lightning_mgpu.demo import GPTLightningModule, TextDataModule

SEED = 1234


def build_module() -> GPTLightningModule:
    return GPTLightningModule(block_size=32, n_layer=2, n_head=4, n_embd=32, lr=3e-3, weight_decay=0.0)


def build_datamodule(batch_size: int) -> TextDataModule:
    return TextDataModule(batch_size=batch_size, block_size=32)


class MicroBatchRecord(L.Callback):
    """Appends each micro-batch's optimizer step, sample ids and loss to this rank's file of this attempt."""

    def __init__(self, directory: str) -> None:
        # A run per process: a node joining restarts the others without counting a restart.
        self.path = Path(directory) / f"rank{os.environ.get('RANK', '0')}-pid{os.getpid()}.jsonl"
        self.enabled = True
        self.steps_before = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        # One rank per data-parallel replica records: its tensor/pipeline peers see the same samples.
        mesh = trainer.strategy.device_mesh  # type: ignore[attr-defined]
        place = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        self.enabled = all(index == 0 for axis, index in place.items() if not axis.startswith("dp"))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.steps_before = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.enabled:
            return
        x = batch[0]
        ids = [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:12] for row in x]
        # The step this micro-batch belongs to: the optimizer's steps taken before it began (also where an epoch's
        # last micro-batch ends an accumulation early).
        step = self.steps_before
        loss = float(outputs["loss"]) * trainer.accumulate_grad_batches  # Lightning hands it divided by those
        line = {"step": step, "ids": ids, "loss": loss, "world": trainer.world_size, "rank": trainer.global_rank}
        line["time"] = time.time()
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def resume_from(trainer: L.Trainer, checkpoint_dir: Path) -> str:
    """``"hpc"`` where SLURM's requeue saved a checkpoint after the last ``last.ckpt``, else ``"last"``."""
    requeued = sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"), key=lambda p: p.stat().st_mtime)
    last = checkpoint_dir / "last.ckpt"
    if requeued and (not last.exists() or requeued[-1].stat().st_mtime > last.stat().st_mtime):
        return "hpc"
    return "last"


def nodes_and_devices() -> tuple[int, int]:
    """The nodes and processes per node this attempt was given: torchrun's elastic agent and a requeued SLURM job
    come back with the nodes that are left, so they are read from the launcher, never written in the script."""
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        return int(os.environ["WORLD_SIZE"]) // per_node, per_node
    if "SLURM_NNODES" in os.environ and "SLURM_NTASKS" in os.environ:  # srun, one task per device
        nodes = int(os.environ["SLURM_NNODES"])
        return nodes, int(os.environ["SLURM_NTASKS"]) // nodes
    return 1, 1


def main(argv: list[str] | None = None, extra_callbacks: tuple[L.Callback, ...] = ()) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", default="elastic_checkpoints")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=16, help="samples per optimizer step, any world")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per data-parallel rank and micro-batch")
    parser.add_argument("--every-n-steps", type=int, default=50, help="checkpoint interval in optimizer steps")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (kept fixed across restarts)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size (kept fixed across restarts)")
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--record-dir", default=None)
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=60.0, help="seconds of silence after which a rank is taken for lost"
    )
    parser.add_argument(
        "--init-timeout", type=float, default=600.0, help="seconds a run's start (process group to first loop) may take"
    )
    args = parser.parse_args(argv)

    L.seed_everything(SEED, verbose=False)
    num_nodes, per_node = nodes_and_devices()
    callbacks: list[L.Callback] = [
        ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.every_n_steps, save_last=True)
    ]
    if args.record_dir:
        callbacks.append(MicroBatchRecord(args.record_dir))
    callbacks.extend(extra_callbacks)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=per_node,
        num_nodes=num_nodes,
        strategy=HybridStrategy(
            tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp,
            zero_stage=args.zero_stage,
            global_batch_size=args.global_batch_size,
            timeout=args.timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            init_timeout=args.init_timeout,
            # Each rank writes its own shards: no save gathers the model on one host, and a restart reads only
            # its slices (the default "full" file is for load_from_checkpoint after training).
            checkpoint_format="sharded",
        ),
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    torch.set_num_threads(1)
    resume = resume_from(trainer, Path(args.checkpoint_dir))
    trainer.fit(build_module(), build_datamodule(args.batch_size), ckpt_path=resume)


if __name__ == "__main__":
    main()
