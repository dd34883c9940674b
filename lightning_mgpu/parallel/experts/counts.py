"""Per-expert token counts for the ``ScalingMonitor``: how evenly a mixture-of-experts model routes its tokens.

Forward pre-hooks on the experts (fused experts modules, torch MoE expert lists, or the expert calls of a list split
over ``ep`` by ``apply.py``), taken off with ``remove()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat.tensors import in_backward
from lightning_mgpu.parallel.experts.sharding import (
    _TOTAL,
    _list_name,
    _LocalExperts,
    _TwoPassCalls,
    find_expert_lists,
    find_experts,
)


class ExpertTokenCounts:
    """While installed: per MoE layer, how many (token, expert) assignments each expert got from this rank's
    forwards, whether or not the experts are split over ep. Recomputations during backward (activation
    checkpointing) are not counted. ``remove()`` takes the hooks off."""

    def __init__(self, module: nn.Module) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        experts: Any  # a fused experts module: num_experts
        for name, experts in find_experts(module).items():  # called with the routing: count its top-k indices
            total = getattr(experts, _TOTAL, experts.num_experts)
            self.counts[name] = torch.zeros(total, dtype=torch.long)
            # Prepended: under ep, the dispatch hook replaces the indices by this rank's received local ones.
            self._handles.append(experts.register_forward_pre_hook(self._routed(name), prepend=True))
        for name, (block, experts) in find_expert_lists(module).items():  # a torch MoE, not split: hook each expert
            self._count_calls(_list_name(name, block, experts), list(experts), None)
        for name, local in module.named_modules():
            calls = getattr(local, "_lightning_mgpu_calls", None)
            if isinstance(local, _LocalExperts) and calls is not None:  # split over ep: the block's expert calls
                self._count_calls(name, [calls.proxies[str(i)] for i in range(calls.total)], calls)

    def _routed(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            if not in_backward():
                flat = args[1].reshape(-1).to("cpu")
                self.counts[name] += torch.bincount(flat, minlength=self.counts[name].numel())

        return hook

    def _count_calls(self, name: str, experts: list[nn.Module], calls: _TwoPassCalls | None) -> None:
        self.counts[name] = torch.zeros(len(experts), dtype=torch.long)
        for index, expert in enumerate(experts):

            def hook(module: nn.Module, args: tuple, index: int = index) -> None:
                # A split list's block runs twice per forward: count the first (recording) pass only.
                if not in_backward() and (calls is None or calls.answers is None):
                    self.counts[name][index] += args[0].shape[0]

            self._handles.append(expert.register_forward_pre_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
