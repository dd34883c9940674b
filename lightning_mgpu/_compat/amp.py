"""GradScaler internals (checked on torch 2.13.0).

``ScalerHooks`` is torch's ``ShardedGradScaler`` with the two private pieces a job-wide scaler needs under public
names: ``unscale_grads`` is ``_unscale_grads_`` (the per-optimizer unscale that returns the found-inf flags; the
public ``unscale_`` calls it and all-reduces the flags), and ``ensure_scale`` initialises the scale tensor the way
``scale()`` would (``_lazy_init_scale_growth_tracker``): a pipeline stage that never scales a loss itself still
holds scaled gradients. ``non_finite_check_and_unscale_`` is the fused kernel ``GradScaler`` uses
(``torch._amp_foreach_non_finite_check_and_unscale_``); ``sparse_values`` is ``Tensor._values()``, the values of an
uncoalesced sparse gradient in place (``values()`` needs a coalesced copy, which unscaling would not reach).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

from lightning_mgpu._compat import changed, internal

non_finite_check_and_unscale_ = internal("torch", "_amp_foreach_non_finite_check_and_unscale_")


def sparse_values(grad: Tensor) -> Tensor:
    return grad._values()


class ScalerHooks(ShardedGradScaler):
    """``ShardedGradScaler`` with ``unscale_grads`` (override it) and ``ensure_scale``."""

    def ensure_scale(self) -> None:
        if not hasattr(self, "_scale") or not hasattr(self, "_lazy_init_scale_growth_tracker"):
            raise AttributeError(changed("GradScaler._scale/_lazy_init_scale_growth_tracker", "torch"))
        if self.is_enabled() and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, Tensor]:
        return self.unscale_grads(optimizer, inv_scale, found_inf, allow_fp16)

    def unscale_grads(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def unscale_locally(self, optimizer: Optimizer) -> None:
        """``GradScaler.unscale_`` without the sharded scaler's all-reduce (one process: nothing to agree on)."""
        return torch.amp.GradScaler.unscale_(self, optimizer)
