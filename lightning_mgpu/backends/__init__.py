"""Alternative engines for a parallel dimension, behind the same strategy and checkpoints (``zero_backend``): the
data-parallel dimension on torch's own wraps (``torch_data_parallel``) or on DeepSpeed (``deepspeed``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from lightning_mgpu.parallel import DataParallelEngine

if TYPE_CHECKING:
    from lightning_mgpu.checkpoint.states import StateAccess
    from lightning_mgpu.options import ParallelOptions


class ZeroBackend(DataParallelEngine, Protocol):
    """A data-parallel engine as the strategy holds it from its construction: also how checkpoints read and write
    the states it holds."""

    def state_access(self) -> StateAccess | None:
        """The checkpointer's access to this engine's states (``None``: torch's tensors and DTensors)."""
        ...


def zero_backend(options: ParallelOptions) -> ZeroBackend:
    """The engine ``options.zero_backend`` names: ``"torch"`` or ``"deepspeed"`` (its engine built in ``setup``)."""
    from lightning_mgpu.backends.deepspeed import DeepSpeedEngineRunner
    from lightning_mgpu.backends.torch_data_parallel import TorchDataParallel

    if options.zero_backend == "deepspeed":
        return DeepSpeedEngineRunner(options.deepspeed_config)
    return TorchDataParallel()
