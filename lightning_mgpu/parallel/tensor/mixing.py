"""Plain-shard regions whose code mixes values across the sharded width, moved to global shapes before training.

The modules of a Hugging Face model run on plain per-rank shards (``apply.py``), which is right for code that treats
each feature (each head) on its own: activations, gates, products. Code that reduces over the sharded width (Gemma
3n's activation sparsity thresholds its MLP's intermediate by the mean and standard deviation over all of it) would
compute each rank's statistic over its own part only, and silently train differently. With global shapes the same
code sees DTensors, whose reductions over a sharded dimension are exact (they communicate).

Which regions need that is found by trying each one once before training, on a small input, both ways: on global
shapes, DTensor communicates exactly where the code mixes the shards, beyond the row-parallel projection's own
reduction. A region whose global-shape call communicates more than its plain-shard call runs on global shapes from
then on (its column-parallel projections hand back DTensors, read at each call through a :class:`ShapeSwitch`).

Only regions that are not attention modules are tried, called with a hidden-state-like tensor alone (an MLP's call);
an attention's call needs position embeddings and masks that do not exist before training. A region whose trial
raises, on either side, keeps plain shards, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from lightning_mgpu.parallel.blocks import is_projection
from lightning_mgpu.parallel.tensor.heads import head_counts
from lightning_mgpu.parallel.tensor.region import GlobalShapeMode, install_global_shape_region

_TRIAL_TOKENS = 2  # per rank: a batch of one sequence this long

OutputFn = Callable[[nn.Module, Any, DeviceMesh], Any]


class ShapeSwitch:
    """Whether a plain-shard region's column-parallel projections hand back global-shape DTensors instead of their
    plain shards: read at each call."""

    def __init__(self) -> None:
        self.global_shapes = False

    def output_fn(self, global_fn: OutputFn, local_fn: OutputFn) -> OutputFn:
        def chosen(module: nn.Module, outputs: object, device_mesh: DeviceMesh) -> Any:
            return (global_fn if self.global_shapes else local_fn)(module, outputs, device_mesh)

        return chosen


def shape_switches(module: nn.Module, regions: set[str]) -> dict[str, ShapeSwitch]:
    """A switch for each plain-shard region that is tried (not an attention module)."""
    return {name: ShapeSwitch() for name in sorted(regions) if not head_counts(module.get_submodule(name))}


def move_mixing_regions(
    module: nn.Module, switches: dict[str, ShapeSwitch], projections: dict[str, str], mesh: DeviceMesh, sequence: bool
) -> list[str]:
    """Try each switchable region (``projections``: column-parallel projection -> its region); those whose code mixes
    the shards run on global shapes from now on. Returns their names."""
    moved = []
    for name, switch in switches.items():
        region = module.get_submodule(name)
        first = next((p for p, r in projections.items() if r == name), None)
        trial = _trial_input(module.get_submodule(first), mesh, sequence) if first else None
        if trial is None:
            continue
        plain = _communications(region, trial)
        switch.global_shapes = True
        with GlobalShapeMode():
            global_shapes = _communications(region, trial)
        switch.global_shapes = plain is not None and global_shapes is not None and global_shapes > plain
        if switch.global_shapes:
            install_global_shape_region(region)
            moved.append(name)
    return moved


def _trial_input(projection: nn.Module, mesh: DeviceMesh, sequence: bool) -> torch.Tensor | None:
    """Zeros as wide as the projection reads, in the residual stream's layout (``sequence``: sharded over tokens)."""
    weight = getattr(projection, "weight", None)
    if not is_projection(projection) or not isinstance(weight, DTensor) or weight.device.type == "meta":
        return None
    width = projection.in_features if isinstance(projection, nn.Linear) else weight.shape[0]
    local = torch.zeros(1, _TRIAL_TOKENS, width, dtype=weight.dtype, device=weight.device)
    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False) if sequence else local


def _communications(region: nn.Module, trial: torch.Tensor) -> int | None:
    """The collectives one call of ``region`` on ``trial`` issues (``None`` if it raises); in evaluation mode and
    with the random state restored, so that training is unaffected."""
    modes = {m: m.training for m in region.modules()}
    devices = [torch.cuda.current_device()] if trial.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), CommDebugMode() as comms:
            region.eval()
            region(trial)
        return comms.get_total_counts()
    except Exception:  # not callable on a hidden state alone, or not on plain shards: left as it is
        return None
    finally:
        for m, training in modes.items():
            m.training = training
