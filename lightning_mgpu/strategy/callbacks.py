"""Lightning callbacks whose assumptions a layout breaks, refused at setup (before any step) with the reason and the
layouts that keep them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.data import stages

# Callbacks that copy the whole module when the run starts (`setup`, before the strategy parallelizes it) and
# average that copy with the module's parameters, paired by position.
_AVERAGING = (StochasticWeightAveraging, WeightAveraging)


def check_callbacks(callbacks: Sequence[Any], layout: ParallelLayout, options: ParallelOptions) -> None:
    averaging = next((c for c in callbacks if isinstance(c, _AVERAGING)), None)
    if averaging is None:
        return
    split = _what_splits_parameters(layout, options)
    if split:
        name = type(averaging).__name__
        raise ValueError(
            f"{name} keeps a whole copy of the module, made before the strategy parallelizes it, and averages it"
            f" with the module's parameters paired by position; under {split}, which that copy cannot be paired"
            " with (Lightning's own weight averaging refuses FSDP and DeepSpeed for the same reason). Train with data"
            f" parallelism at zero_stage=0 or 1 (every rank holds the whole model, as under DDP), or without {name}."
        )


def _what_splits_parameters(layout: ParallelLayout, options: ParallelOptions) -> str:
    """What, in this layout, leaves a rank without its parameters whole and plain ("" if nothing does)."""
    if options.zero_backend == "deepspeed":
        return "zero_backend='deepspeed' the DeepSpeed engine keeps the parameters in its own partitions"
    if layout.pipeline_parallel_size > 1:
        return f"pipeline_parallel_size={layout.pipeline_parallel_size} each rank holds only its stages' parameters"
    if layout.tensor_parallel_size > 1:
        return f"tensor_parallel_size={layout.tensor_parallel_size} each rank holds shards of them (DTensors)"
    if stages.shards_parameters(layout):
        return "ZeRO-2/3 each rank holds shards of them (DTensors)"
    if options.expert_parallel_size > 1:
        return f"expert_parallel_size={options.expert_parallel_size} each rank holds only its experts"
    return ""
