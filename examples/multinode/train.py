"""Train the demo GPT on several nodes: tensor parallelism inside each node, pipeline parallelism across nodes.

The LightningModule (``lightning_mgpu.demo.GPTLightningModule``) is the single-device one; only the Trainer's
``devices``, ``num_nodes`` and ``strategy`` say how it is spread. Every node runs this same script, started by a
launcher that sets the rank variables (``torchrun.sh`` or ``slurm.sbatch`` next to this file); Lightning then
uses the processes it was given instead of starting its own.

    # one node, 8 GPUs each, 2 nodes: tp 8 inside a node, pp 2 across the nodes
    NNODES=2 NPROC_PER_NODE=8 NODE_RANK=0 MASTER_ADDR=node0 bash examples/multinode/torchrun.sh --tp 8 --pp 2
    # the same nodes, data parallel only: ZeRO-3 shards inside each node and replicates across them (HSDP)
    NNODES=2 NPROC_PER_NODE=8 NODE_RANK=0 MASTER_ADDR=node0 bash examples/multinode/torchrun.sh --zero-stage 3 \
        --shard-size 8 --batch-size 1

The rank order is node-major (ranks ``n * devices .. (n + 1) * devices - 1`` live on node ``n``) and the mesh
is ``(pp, dp, tp)`` with ``tp`` innermost, so a ``tensor_parallel_size`` that divides the devices of a node keeps
every tensor-parallel group, whose collectives run in every layer, on one node; the pipeline's point-to-point
sends (one activation per microbatch and stage) are what crosses the network.

``--report-dir DIR`` writes ``DIR/rank<R>.json`` per rank: the node it ran on, its mesh coordinate, the global
ranks of its tp/dp/pp groups, and the per-step training losses (the test suite checks these).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch.distributed as dist

from lightning_mgpu import HybridStrategy
from lightning_mgpu.demo import GPTLightningModule, TextDataModule

SEED = 1234


def build_module() -> GPTLightningModule:
    """A small GPT (~0.2M parameters; raise the sizes for real runs). Heads and widths divide tp 2, 4 and 8."""
    return GPTLightningModule(block_size=32, n_layer=4, n_head=8, n_embd=64, lr=3e-3, weight_decay=0.0)


def build_datamodule(batch_size: int = 8) -> TextDataModule:
    """The bundled Shakespeare text as byte tokens: nothing is downloaded. ``batch_size`` per data-parallel rank."""
    return TextDataModule(batch_size=batch_size, block_size=32)


class LayoutReport(L.Callback):
    """Records the per-step loss and, once training ends, where this rank sits in the device mesh."""

    def __init__(self, report_dir: Optional[str]) -> None:
        self.report_dir = Path(report_dir) if report_dir else None
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.report_dir is None:
            return
        strategy = trainer.strategy
        mesh = strategy.device_mesh
        groups = {
            name: dist.get_process_group_ranks(mesh[name].get_group()) for name in mesh.mesh_dim_names
        }
        report = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "host": socket.gethostname(),
            "cluster_environment": type(strategy.cluster_environment).__name__,  # how Lightning found the ranks
            "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR")},
            "mesh_dim_names": list(mesh.mesh_dim_names),
            "mesh_shape": list(mesh.shape),
            "coordinate": list(mesh.get_coordinate()),
            "groups": groups,
            "layout": strategy.layout.describe(),
            "losses": self.losses,
        }
        self.report_dir.mkdir(parents=True, exist_ok=True)
        path = self.report_dir / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(report, indent=1))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("NNODES", 1)), help="Trainer(num_nodes=)")
    parser.add_argument("--devices", type=int, default=None,
                        help="processes per node, Trainer(devices=); default: LOCAL_WORLD_SIZE set by torchrun")
    parser.add_argument("--accelerator", default="auto", help="'gpu', 'cpu' or 'auto'")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (keep it a divisor of --devices)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=None,
                        help="data_parallel_shard_size: ZeRO shards inside groups of this many ranks (a node), HSDP")
    parser.add_argument("--schedule", default="1F1B", help="pipeline_schedule")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    parser.add_argument("--report-dir", default=None, help="write rank<R>.json files here")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    pipeline = {"pipeline_schedule": args.schedule} if args.pp > 1 else {}  # a pp option at pp=1 is refused
    strategy = HybridStrategy(
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        zero_stage=args.zero_stage,
        data_parallel_shard_size=args.shard_size,
        timeout=args.timeout,
        **pipeline,
    )
    L.seed_everything(SEED)
    report = LayoutReport(args.report_dir)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=args.nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        callbacks=[report],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(build_module(), build_datamodule(args.batch_size))
    if trainer.global_rank == 0:
        print(f"layout: {strategy.layout.describe()}; losses: {[round(x, 4) for x in report.losses]}")


if __name__ == "__main__":
    main()
