"""Weights shared by modules on different pipeline stages stay one weight (a head tied to the input embedding).

After the split, every rank whose stages use a tied parameter holds its own copy (and a rank running two such
stages holds two once each stage is its own data-parallel root), and backward gives each copy only its own
stage's share of the gradient. As Megatron does with its embedding group, the copies' gradients are summed
before every optimizer step; the copies start equal, get equal gradients and equal updates, so they stay equal.
Gradient norms count the weight once, on its first holder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mgpu.layout import PP_AXIS
from lightning_mgpu.parallel.blocks import tied_parameters

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class CrossStageTie:
    """One tied Parameter used by several stages: its names in the unsplit model, the pipeline ranks holding it."""

    names: tuple[str, ...]
    pp_ranks: tuple[int, ...]


def find_cross_stage_ties(
    module: nn.Module, stage_of: Mapping[str, int], stage_ranks: list[int]
) -> list[CrossStageTie]:
    """The tied parameters of ``module`` (before it is split) used by more than one stage.

    ``stage_of`` maps the FQN of each module the split places to its stage (modules under it go with it; the
    split's ``module_stages``); ``stage_ranks[s]`` is the pipeline rank that runs stage ``s``.
    """
    ties = []
    for holders in tied_parameters(module):
        stages = {_stage_of(holder, stage_of) for holder, _ in holders} - {None}
        if len(stages) > 1:
            names = tuple(f"{holder}.{name}" if holder else name for holder, name in holders)
            ties.append(CrossStageTie(names, tuple(sorted({stage_ranks[s] for s in stages}))))  # type: ignore[index]
    return ties


def _stage_of(module_name: str, stage_of: Mapping[str, int]) -> int | None:
    for prefix, stage in stage_of.items():
        if module_name == prefix or module_name.startswith(prefix + "."):
            return stage
    return None  # used by every stage (a parameter the split leaves on all ranks)


class TiedGradients:
    """Sums the gradients of cross-stage tied parameters over the ranks holding them, one group per tie.

    Built on every rank of the job alike (process groups are created collectively): one group per set of holding
    pipeline ranks and per (data, tensor) coordinate, so each holder meets the copy of the same shard.
    """

    def __init__(self, ties: list[CrossStageTie], mesh: DeviceMesh, pp_rank: int) -> None:
        assert mesh.mesh_dim_names is not None, "the job's mesh names its dimensions"
        pp_axis = mesh.mesh_dim_names.index(PP_AXIS)
        columns = mesh.mesh.movedim(pp_axis, 0).reshape(mesh.mesh.shape[pp_axis], -1)
        my_rank = dist.get_rank()
        groups: dict[tuple[int, ...], ProcessGroup | None] = {}
        self._mine: list[tuple[CrossStageTie, ProcessGroup | None]] = []
        for tie in ties:
            if len(tie.pp_ranks) > 1 and tie.pp_ranks not in groups:
                for column in columns.t().tolist():
                    ranks = [column[r] for r in tie.pp_ranks]
                    group = dist.new_group(ranks)
                    if my_rank in ranks:
                        groups[tie.pp_ranks] = group
                groups.setdefault(tie.pp_ranks, None)
            if pp_rank in tie.pp_ranks:
                self._mine.append((tie, groups.get(tie.pp_ranks)))
        self._first_holder = {tie: tie.pp_ranks[0] == pp_rank for tie, _ in self._mine}

    def __bool__(self) -> bool:
        return bool(self._mine)

    def sum_gradients(self, module: nn.Module) -> None:
        """Make every copy's gradient the sum over the stages using it. Call on every holder, after backward."""
        for tie, group in self._mine:
            copies = _copies(module, tie)
            if len(copies) == 1 and group is None:
                continue  # one Parameter on one rank: autograd already added its uses up
            grads = [_local(_grad_or_zeros(copy)) for copy in copies]
            for grad in grads[1:]:
                grads[0].add_(grad)
            if group is not None:
                dist.all_reduce(grads[0], group=group)
            for grad in grads[1:]:
                grad.copy_(grads[0])

    def counted_elsewhere(self, module: nn.Module) -> set[int]:
        """``id``s of this rank's tied copies whose gradient norm another copy already counts."""
        counted = set()
        for tie, _ in self._mine:
            ids = [id(copy) for copy in _copies(module, tie)]
            counted.update(ids if not self._first_holder[tie] else ids[1:])
        return counted


def _copies(module: nn.Module, tie: CrossStageTie) -> list[nn.Parameter]:
    """This rank's distinct copies, under the tie's names whose modules it kept (looked up now: wraps replace
    Parameters)."""
    copies: dict[int, nn.Parameter] = {}
    for name in tie.names:
        try:
            param = module.get_parameter(name)
        except AttributeError:
            continue  # a module of another rank's stage
        copies.setdefault(id(param), param)
    if not copies:
        raise RuntimeError(f"lightning-mgpu: this rank holds none of {tie.names}; please report this.")
    return list(copies.values())


def _grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    if param.grad is None:  # not used by this stage in this step; the other copies still wait for its share
        param.grad = torch.zeros_like(param)
    return param.grad


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
