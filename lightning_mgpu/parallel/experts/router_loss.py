"""The router's load-balancing loss on the whole data-parallel batch, as one process computes it.

Hugging Face MoE models (Mixtral, Qwen3-MoE, OLMoE, ... with ``output_router_logits=True``) add
``load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` to their loss: a product of two means
over the batch's tokens (the fraction of tokens sent to each expert and the mean router probability). On each
data-parallel rank's own part of the batch it is not one process's on the whole batch (a mean of products is not a
product of means), and plain DDP trains with that difference.

Here, while a training forward of such a model runs, its module's ``load_balancing_loss_func`` is swapped for one
that first gathers every data-parallel rank's router logits (and attention mask) and then calls the model's own
function on them. Every rank gets one process's value; the gather is an autograd all-reduce, whose backward sums each
rank's router-logit gradients over the ranks (``dp`` times one process's), which the data-parallel gradient mean
divides back by ``dp``. Cost: one all-reduce of ``layers x tokens x experts`` values forward and backward.
Evaluation forwards keep each rank's own loss (no collective a single rank's forward could wait on).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_NAME = "load_balancing_loss_func"
_SIGNATURE = ["gate_logits", "num_experts", "top_k", "attention_mask"]


def find_router_losses(module: nn.Module) -> dict[str, nn.Module]:
    """``{fqn: model}``: modules whose forward calls their modeling file's ``load_balancing_loss_func`` with
    Hugging Face's signature ``(gate_logits, num_experts, top_k, attention_mask)``."""
    found = {}
    for name, sub in module.named_modules():
        forward = inspect.unwrap(type(sub).forward)
        function = getattr(forward, "__globals__", {}).get(_NAME)
        if _NAME in getattr(getattr(forward, "__code__", None), "co_names", ()) and callable(function):
            if list(inspect.signature(function).parameters)[:4] == _SIGNATURE:
                found[name] = sub
    return found


def apply_global_router_loss(module: nn.Module, group: ProcessGroup) -> list[RemovableHandle]:
    """Make every Hugging Face load-balancing loss inside ``module`` one process's over ``group`` (the data-parallel
    ranks) during training forwards. Returns the hooks' handles: removing them undoes it."""
    handles = []
    for model in find_router_losses(module).values():
        swap = _Swap(inspect.unwrap(type(model).forward).__globals__, group)
        handles.append(model.register_forward_pre_hook(swap.enter))
        handles.append(model.register_forward_hook(swap.leave, always_call=True))
    return handles


class _Swap:
    """The modeling file's ``load_balancing_loss_func`` replaced for the length of one training forward."""

    def __init__(self, namespace: dict[str, Any], group: ProcessGroup) -> None:
        self.namespace, self.group = namespace, group
        self.original: Callable[..., object] = namespace[_NAME]
        self.depth = 0

    def enter(self, module: nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            if self.depth == 0:
                self.namespace[_NAME] = self.gathered
            self.depth += 1

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.depth:
            self.depth -= 1
            if self.depth == 0:
                self.namespace[_NAME] = self.original

    def gathered(self, *args: object, **kwargs: object) -> Any:
        bound = inspect.signature(self.original).bind(*args, **kwargs)
        logits, mask = bound.arguments.get("gate_logits"), bound.arguments.get("attention_mask")
        if isinstance(logits, tuple) and logits:
            rows = logits[0].shape[0]
            stacked = torch.stack([layer.to(logits[0].device) for layer in logits])  # [layers, rows, experts]
            counts = _gather_rows(stacked.new_tensor([rows], dtype=torch.long), self.group)
            everyone = _gather(stacked, counts, dim=1, group=self.group)
            bound.arguments["gate_logits"] = tuple(everyone.unbind(0))
            if mask is not None:
                flat = mask.reshape(-1).to(stacked.dtype)  # as the function reads it: one weight per row
                bound.arguments["attention_mask"] = _gather(flat, counts, dim=0, group=self.group).detach()
        return self.original(*bound.args, **bound.kwargs)


def _gather_rows(rows: torch.Tensor, group: ProcessGroup) -> list[int]:
    out = [torch.zeros_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, rows, group=group)
    return [int(r) for r in out]


def _gather(tensor: torch.Tensor, counts: list[int], dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` (sizes ``counts``): a zero-padded autograd all-reduce."""
    from torch.distributed.nn.functional import all_reduce

    rank, largest = dist.get_rank(group), max(counts)

    def zeros(n: int) -> torch.Tensor:
        shape = (*tensor.shape[:dim], n, *tensor.shape[dim + 1 :])
        return torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)

    after = (len(counts) - rank) * largest - tensor.shape[dim]
    padded = torch.cat([zeros(rank * largest), tensor, zeros(after)], dim=dim)  # this rank's slot holds its rows
    summed = all_reduce(padded, group=group)
    return torch.cat([summed.narrow(dim, r * largest, n) for r, n in enumerate(counts)], dim=dim)


def check_no_router_loss(module: nn.Module, reason: str) -> None:
    """Refuse a Hugging Face model whose load-balancing loss is on (``config.output_router_logits``) where it would
    not be one process's; ``reason`` names the layout and why."""
    on = [
        type(m).__name__
        for m in find_router_losses(module).values()
        if getattr(getattr(m, "config", None), "output_router_logits", False) is True
    ]
    if on:
        raise NotImplementedError(
            f"{on[0]}'s load-balancing loss (config.output_router_logits=True) with {reason}. Set"
            " config.output_router_logits=False, or train without pipeline parallelism (data x expert parallelism"
            " computes the loss as one process)."
        )
