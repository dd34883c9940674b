"""Parallelizers, applied to the LightningModule in a fixed order after ``configure_model``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_mgpu.layout import DP_AXIS, TP_AXIS, ParallelLayout
from lightning_mgpu.parallel.data import apply_data_parallel
from lightning_mgpu.parallel.tensor import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mgpu.options import ParallelOptions


def parallelize(module: nn.Module, layout: ParallelLayout, mesh: "DeviceMesh", options: "ParallelOptions") -> None:
    """Apply every parallelism of ``layout`` to ``module`` in place: tensor, pipeline, checkpointing, data."""
    if layout.tensor_parallel_size > 1:
        apply_tensor_parallel(module, mesh[TP_AXIS], options.tp_plan, options.sequence_parallel)
    if layout.data_parallel_size > 1:
        apply_data_parallel(module, mesh[DP_AXIS], layout.zero_stage)
