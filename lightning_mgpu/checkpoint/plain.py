"""The trained states put back into the user's plain module and optimizers when a run ends.

The parallel module holds sharded (DTensor) parameters, and under pipelining each rank only its stages. At
teardown every rank gathers every parameter and buffer whole, by name (``full_named_tensors``), the module snapshot
taken before parallelizing brings back the original module tree with those values, and the optimizers are
pointed at the original parameters, their states made plain (``DTensor.full_tensor``), so that both work in plain
torch, and a checkpoint saved after ``fit`` describes them under the plain FQNs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mgpu.checkpoint.states import full_named_tensors
from lightning_mgpu.parallel.experts import with_peers_listed_experts
from lightning_mgpu.patches import ModuleSnapshot, PatchLog

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def restore_plain(
    snapshot: ModuleSnapshot, optimizers: list[Optimizer], patches: PatchLog, pp_group: ProcessGroup | None = None
) -> None:
    """Put back ``snapshot.module`` with its trained values and re-point ``optimizers`` at it. Collective.

    The states are gathered from the parallel module first; then ``patches`` are undone and the snapshot restored.
    """
    module = snapshot.module
    live_names: dict[nn.Parameter, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        live_names.setdefault(param, name)
    optimizer_states = [_plain_states(optimizer) for optimizer in optimizers]
    state_dict = with_peers_listed_experts(module, full_named_tensors(module, pp_group))
    patches.undo()
    snapshot.restore(state_dict)
    originals = dict(module.named_parameters(remove_duplicate=False))
    for optimizer, states in zip(optimizers, optimizer_states):
        _repoint(optimizer, states, {live: originals[name] for live, name in live_names.items() if name in originals})


def _plain_states(optimizer: Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """The optimizer's per-parameter states with every DTensor gathered (the same order on every rank)."""
    return {
        param: {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}
        for group in optimizer.param_groups
        for param in group["params"]
        if (state := optimizer.state.get(param))
    }


def _repoint(
    optimizer: Optimizer, states: dict[torch.Tensor, dict[str, Any]], original: dict[Any, nn.Parameter]
) -> None:
    for group in optimizer.param_groups:
        group["params"] = [original.get(param, param) for param in group["params"]]
    optimizer.state = defaultdict(dict, {original.get(param, param): state for param, state in states.items()})
