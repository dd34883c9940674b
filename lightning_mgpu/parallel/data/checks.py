"""The data-parallel options against one layout, checked when the Trainer is built (before any process starts)."""

from __future__ import annotations

from lightning_mgpu.layout import ParallelLayout, divisors
from lightning_mgpu.options import ParallelOptions, refuse_compositions


def check(layout: ParallelLayout, options: ParallelOptions) -> None:
    """Hybrid sharding (``data_parallel_shard_size``): a shard size that divides ``dp``, a ZeRO stage that shards,
    and the compositions this version implements."""
    shard, dp = layout.data_parallel_shard_size, layout.data_parallel_size
    if shard is None:
        return
    if dp % shard:
        raise ValueError(
            f"data_parallel_shard_size={shard} must divide data_parallel_size={dp}: ZeRO shards over groups of that"
            f" many data-parallel ranks and replicates across dp / shard groups. Choose it from {divisors(dp)}"
            " (the devices of one node, typically), or None to shard over all data-parallel ranks."
        )
    if layout.zero_stage == 0:
        raise ValueError(
            f"data_parallel_shard_size={shard} says over how many ranks ZeRO shards its states, but zero_stage=0"
            " shards nothing. Set zero_stage to 1, 2 or 3, or remove data_parallel_shard_size."
        )
    refuse_compositions(
        f"data_parallel_shard_size={shard}",
        {
            "zero_backend='deepspeed'": options.zero_backend != "torch",
            f"expert_parallel_size={layout.expert_parallel_size}": layout.expert_parallel_size > 1,
        },
        "hybrid sharding runs on the torch backend (FSDP2 on a 2-D mesh), and expert parallelism already cuts the"
        " data-parallel ranks its own way. Remove data_parallel_shard_size, or use zero_backend='torch' and"
        " expert_parallel_size=1.",
    )
