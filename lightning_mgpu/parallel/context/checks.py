"""Context-parallel options against one layout, checked when the Trainer is built (before any process starts)."""

from __future__ import annotations

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions, refuse_compositions


def check(layout: ParallelLayout, options: ParallelOptions) -> None:
    """The compositions this version implements with ``context_parallel_size > 1``."""
    cp = layout.context_parallel_size
    if cp == 1:
        return
    shard = layout.data_parallel_shard_size
    refuse_compositions(
        f"context_parallel_size={cp}",
        {
            "zero_backend='deepspeed'": options.zero_backend != "torch",
            f"expert_parallel_size={layout.expert_parallel_size}": layout.expert_parallel_size > 1,
            f"data_parallel_shard_size={shard}": shard is not None,
        },
        "context parallelism averages gradients over dp x cp with the torch backend's data-parallel wrap, over all"
        " data-parallel ranks. Remove those options, or use context_parallel_size=1.",
    )
