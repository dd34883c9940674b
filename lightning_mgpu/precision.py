"""HybridPrecision: the Precision plugin that matches HybridStrategy.

It chooses autocast per device type and clips gradients by their true global norm, whichever way parameters and
gradients are split over data, tensor and pipeline ranks.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.parallel.grads import clip_grad_norm_

_PrecisionName = Literal["32-true", "bf16-mixed"]
SUPPORTED = ("32-true", "bf16-mixed")
_PLANNED = ("16-mixed", "bf16-true", "16-true")

_AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class HybridPrecision(Precision):
    """Precision for :class:`~lightning_mgpu.HybridStrategy`.

    Args:
        precision: ``"32-true"`` or ``"bf16-mixed"`` (autocast to bfloat16, fp32 master weights).
        device_type: where autocast runs; set by the strategy from its root device.
    """

    def __init__(self, precision: Union[_PrecisionName, str] = "32-true", device_type: str = "cpu") -> None:
        precision = str(precision)
        if precision in _PLANNED:
            raise NotImplementedError(
                f"HybridPrecision({precision!r}) is not available yet; use one of {SUPPORTED}."
            )
        if precision not in SUPPORTED:
            raise ValueError(f"HybridPrecision does not support precision={precision!r}. Choose one of {SUPPORTED}.")
        self.precision = precision  # type: ignore[assignment]
        self.device_type = device_type
        # Set by the strategy: the group over which gradient norms of different shards must be summed.
        self.grad_norm_group: Optional[Any] = None

    @classmethod
    def from_lightning(cls, plugin: Precision, device_type: str) -> "HybridPrecision":
        """Translate the plugin Lightning picked from ``Trainer(precision=...)``."""
        if isinstance(plugin, HybridPrecision):
            plugin.device_type = device_type
            return plugin
        if isinstance(plugin, (MixedPrecision, HalfPrecision)):
            return cls(plugin.precision, device_type)
        if type(plugin) is Precision:
            return cls("32-true", device_type)
        name = "64-true" if isinstance(plugin, DoublePrecision) else type(plugin).__name__
        raise ValueError(f"HybridStrategy does not support the precision {name!r}. Choose one of {SUPPORTED}.")

    @contextmanager
    def _autocast(self) -> Generator[None, None, None]:
        dtype = _AUTOCAST_DTYPE.get(self.precision)
        context = torch.autocast(self.device_type, dtype=dtype) if dtype is not None else nullcontext()
        with context:
            yield

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self._autocast():
            yield

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(list(self.main_params(optimizer)), clip_val, cross_stage_group=self.grad_norm_group)
