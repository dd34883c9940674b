"""lightning-mgpu: data, tensor and pipeline parallelism with ZeRO for unchanged Lightning modules."""

__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mgpu._compat import versions as _versions  # noqa: F401 - refuses untested frameworks before any shim
from lightning_mgpu.launch import RankFailedError
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.monitor import ScalingMonitor
from lightning_mgpu.precision import HybridPrecision
from lightning_mgpu.strategy import HybridStrategy

HybridStrategy.register_strategies(StrategyRegistry)

__all__ = ["HybridPrecision", "HybridStrategy", "ParallelLayout", "RankFailedError", "ScalingMonitor", "__version__"]
