"""The global batch kept on any world size: ``HybridStrategy(global_batch_size=N)`` sets the gradient accumulation.

The same config then trains the same on 8 or 64 devices, and a job restarted on fewer devices keeps its samples per
optimizer step: ``accumulate_grad_batches = N / (per-rank batch x data-parallel size)``. Tensor, pipeline and
context-parallel peers share their samples and do not count.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.checkpoint.resume import loader_batch_size
from lightning_mgpu.layout_checks import accumulation_for


def per_rank_batch_size(dataloader: Any) -> int:
    """The training DataLoader's batch size (its ``batch_size``, or its batch sampler's)."""
    size = loader_batch_size(dataloader)
    if size is None:
        raise ValueError(
            "global_batch_size needs the training DataLoader's batch size, but it has none (a custom batch sampler"
            " without `batch_size`). Set Trainer(accumulate_grad_batches=...) yourself instead."
        )
    return size


def keep_global_batch(trainer: Any, global_batch_size: int, data_parallel_size: int) -> None:
    """Set ``trainer.accumulate_grad_batches`` for ``global_batch_size`` (before the first training step)."""
    per_rank = per_rank_batch_size(trainer.train_dataloader)
    accumulate = accumulation_for(global_batch_size, per_rank, data_parallel_size, trainer.accumulate_grad_batches)
    trainer.accumulate_grad_batches = accumulate
    rank_zero_info(
        f"global_batch_size={global_batch_size}: {per_rank} per rank x {data_parallel_size} data-parallel ranks x"
        f" {accumulate} accumulated micro-batches per optimizer step."
    )
