"""Lightning callbacks whose assumptions a layout breaks, refused at setup (before any step) with the reason and the
layouts that keep them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.data import shards_parameters

# Callbacks that copy the whole module when the run starts (`setup`, before the strategy parallelizes it) and
# average that copy with the module's parameters, paired by position.
_AVERAGING = (StochasticWeightAveraging, WeightAveraging)


def check_callbacks(callbacks: Sequence[Any], layout: ParallelLayout, options: ParallelOptions) -> None:
    for averaging in (c for c in callbacks if isinstance(c, _AVERAGING)):
        _check_averaging(averaging, layout, options)


def _check_averaging(averaging: Any, layout: ParallelLayout, options: ParallelOptions) -> None:
    name = type(averaging).__name__
    if isinstance(averaging, WeightAveraging):
        # Its copy is laid out as the module once parallelized (`strategy/averaging.py`), where every rank holds
        # its shards of every parameter; not where ranks hold other parameters, or an engine holds them.
        split = _what_places_parameters_elsewhere(layout, options)
        keeps = "data parallelism (ZeRO 0-3), tensor parallelism or both"
    else:
        split = _what_places_parameters_elsewhere(layout, options) or _what_shards_parameters(layout)
        keeps = "data parallelism at zero_stage=0 or 1 (every rank holds the whole model, as under DDP)"
    if split:
        raise ValueError(
            f"{name} keeps a whole copy of the module, made before the strategy parallelizes it, and averages it"
            f" with the module's parameters paired by position; under {split}, which that copy cannot be paired"
            " with (Lightning's own weight averaging refuses FSDP and DeepSpeed for the same reason). Train with"
            f" {keeps}, or without {name}." + (_SWA_SHARDED if split == _what_shards_parameters(layout) else "")
        )


# Why StochasticWeightAveraging stays refused where WeightAveraging trains: it saves its averaged copy inside the
# callback's own state (written by rank 0 alone) and runs its own batch-norm pass over that copy.
_SWA_SHARDED = (
    " (StochasticWeightAveraging saves its averaged copy in the callback's state, which one rank writes: use"
    " WeightAveraging, which trains under sharded layouts)"
)


def _what_shards_parameters(layout: ParallelLayout) -> str:
    """What leaves each rank with shards (DTensors) of every parameter ("" if nothing does)."""
    if layout.tensor_parallel_size > 1:
        return f"tensor_parallel_size={layout.tensor_parallel_size} each rank holds shards of them (DTensors)"
    if shards_parameters(layout):
        return "ZeRO-2/3 each rank holds shards of them (DTensors)"
    return ""


def _what_places_parameters_elsewhere(layout: ParallelLayout, options: ParallelOptions) -> str:
    """What leaves a rank without some parameters, or with them inside an engine ("" if nothing does)."""
    if options.zero_backend == "deepspeed":
        return "zero_backend='deepspeed' the DeepSpeed engine keeps the parameters in its own partitions"
    if layout.pipeline_parallel_size > 1:
        return f"pipeline_parallel_size={layout.pipeline_parallel_size} each rank holds only its stages' parameters"
    if layout.expert_parallel_size > 1:
        return f"expert_parallel_size={layout.expert_parallel_size} each rank holds only its experts"
    return ""
