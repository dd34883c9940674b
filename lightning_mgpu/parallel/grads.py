"""Gradient norms and clipping across shards: the norm a single process would compute, whatever the layout."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    cross_stage_group: ProcessGroup | None = None,
    counted_elsewhere: AbstractSet[int] = frozenset(),
) -> torch.Tensor:
    """The global ``norm_type``-norm of all gradients.

    DTensor gradients (sharded by FSDP2 or tensor parallel) are reduced by DTensor itself, one collective per
    distinct (mesh, placements); ``cross_stage_group`` sums the contributions of different pipeline stages, which
    hold disjoint parameters but for tied copies, whose ``id``s in ``counted_elsewhere`` another stage counts.
    """
    by_layout: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None and id(param) not in counted_elsewhere:
            grad = param.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            by_layout[key].append(grad)
    partial_norms = []
    for grads in by_layout.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        partial_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not partial_norms:
        total = torch.zeros(())
    else:
        # The norm of the partial norms is the norm of everything, for any p and for inf.
        total = torch.nn.utils.get_total_norm(partial_norms, norm_type)
    if cross_stage_group is not None:
        total = _combine_across(total.float(), norm_type, cross_stage_group)
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    cross_stage_group: ProcessGroup | None = None,
    counted_elsewhere: AbstractSet[int] = frozenset(),
) -> torch.Tensor:
    """Scale gradients in place so that their global norm is at most ``max_norm``; return the norm before."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, cross_stage_group, counted_elsewhere)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in parameters:
        if param.grad is None:
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        grad.mul_(coefficient.to(device=grad.device, dtype=grad.dtype))
    return total


def clip_grad_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient to ``[-clip_value, clip_value]`` in place. Elementwise, so each DTensor gradient is
    clamped on its local shard (torch's ``clip_grad_value_`` runs one foreach call over all gradients, which DTensor
    refuses when plain and DTensor gradients mix, as under tensor parallelism); a pending (``Partial``) gradient is
    reduced first, since the clamp of a partial sum is not the clamp of the sum."""
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):
                placements = [Replicate() if p.is_partial() else p for p in grad.placements]
                grad = param.grad = grad.redistribute(grad.device_mesh, placements)
            grad = grad.to_local()
        grad.clamp_(-clip_value, clip_value)


def _combine_across(norm: torch.Tensor, norm_type: float, group: ProcessGroup) -> torch.Tensor:
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)
