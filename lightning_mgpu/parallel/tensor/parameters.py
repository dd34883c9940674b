"""A module's own parameters made DTensors of the placements a style gives them: the partition function every
style hands ``distribute_module``."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor


def distribute_parameters(
    placements: dict, src_data_rank: int | None, name: str, module: nn.Module, mesh: DeviceMesh
) -> None:
    """``module``'s parameters named in ``placements`` distributed as placed (those already DTensors, or absent,
    left as they are); ``name`` is the module's FQN, as ``distribute_module`` passes it."""
    for param_name, placement in placements.items():
        param = getattr(module, param_name, None)
        if param is None or isinstance(param, DTensor):
            continue
        distributed = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(param_name, nn.Parameter(distributed, requires_grad=param.requires_grad))
