"""What a ZeRO stage means for the rest of the run, answered here once from the layout.

Stage 0 replicates everything (DDP); 1 also partitions the optimizer states over the data-parallel ranks
(``OptimizerStateSharding``, after the optimizers exist); 2 keeps gradients and parameters as FSDP2 shards
between steps, gathered for each step; 3 also frees each block's gathered parameters after its forward. With one
gradient rank nothing is partitioned whatever the stage. The strategy, the callbacks' checks and the parallelisms
ask these questions instead of comparing stage numbers themselves.
"""

from __future__ import annotations

from lightning_mgpu.layout import ParallelLayout


def partitions_optimizer_states(layout: ParallelLayout) -> bool:
    """ZeRO-1: the parameters and gradients stay whole, each rank steps and holds its part of the optimizer."""
    return layout.zero_stage == 1 and layout.gradient_ranks > 1


def shards_parameters(layout: ParallelLayout) -> bool:
    """ZeRO-2/3 over several ranks: between steps a rank holds shards (DTensors) of the parameters, not them."""
    return layout.zero_stage >= 2 and layout.gradient_ranks > 1


def can_leave_gathered(layout: ParallelLayout) -> bool:
    """ZeRO-2/3: FSDP2 groups that an interrupted step may leave gathered (whatever the number of ranks)."""
    return layout.zero_stage >= 2


def frees_after_forward(layout: ParallelLayout) -> bool:
    """ZeRO-3: each block's parameters are gathered for its forward and freed after it (fp8 then all-gathers in
    fp8), also with one gradient rank (the wrap casts and offloads there)."""
    return layout.zero_stage == 3


def replicates_parameters(layout: ParallelLayout) -> bool:
    """ZeRO-0/1: every data-parallel rank holds the whole parameters (DDP's wrap, FSDP2's replicate beside tp or
    pp, the experts' replicas)."""
    return layout.zero_stage <= 1
