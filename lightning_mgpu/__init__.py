"""lightning-mgpu: data, tensor and pipeline parallelism with ZeRO for unchanged Lightning modules.

The public names load on first use (PEP 562), so that ``lightning-mgpu --help`` answers without importing torch
and Lightning. ``Trainer(strategy="hybrid_zero2")`` still works once ``lightning_mgpu`` is imported: the strategy
registers its names with Lightning now when Lightning is loaded already, or as soon as Lightning is (see
:func:`_register_with_lightning`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "HybridPrecision": "lightning_mgpu.precision",
    "HybridStrategy": "lightning_mgpu.strategy",
    "ParallelLayout": "lightning_mgpu.layout",
    "RankFailedError": "lightning_mgpu.launch",
    "ScalingMonitor": "lightning_mgpu.monitor",
}

if TYPE_CHECKING:  # what type checkers and the API reference (griffe) read
    from lightning_mgpu.launch import RankFailedError
    from lightning_mgpu.layout import ParallelLayout
    from lightning_mgpu.monitor import ScalingMonitor
    from lightning_mgpu.precision import HybridPrecision
    from lightning_mgpu.strategy import HybridStrategy

__all__ = ["HybridPrecision", "HybridStrategy", "ParallelLayout", "RankFailedError", "ScalingMonitor", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_mgpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_LIGHTNING = "lightning.pytorch"


def _hybrid_strategy(**init_params: Any) -> Any:
    """What Lightning's registry calls for ``strategy="hybrid..."``: the strategy class loads when a Trainer asks."""
    from lightning_mgpu.strategy import HybridStrategy

    return HybridStrategy(**init_params)


def _register_names(registry: Any, strategy: Any = _hybrid_strategy) -> None:
    """``"hybrid"`` (ZeRO 0) and ``"hybrid_zero0"``..``"hybrid_zero3"`` in Lightning's strategy registry."""
    registry.register("hybrid", strategy, description="lightning-mgpu HybridStrategy (ZeRO stage 0)", override=True)
    for stage in range(4):
        description = f"lightning-mgpu HybridStrategy, ZeRO stage {stage}"
        registry.register(f"hybrid_zero{stage}", strategy, description=description, override=True, zero_stage=stage)


def _register_in(module: ModuleType) -> None:
    _register_names(sys.modules[f"{module.__name__}.strategies"].StrategyRegistry)
    from lightning_mgpu._compat.lightning import read_directories_in_load_from_checkpoint

    read_directories_in_load_from_checkpoint(_read_sharded)


def _read_sharded(path: Any) -> Any:
    """``MyModule.load_from_checkpoint(path)`` on a sharded checkpoint of this package: its states joined in memory,
    as ``lightning-mgpu consolidate`` writes them (``None`` for any other directory)."""
    from lightning_mgpu.checkpoint.format import is_sharded_checkpoint

    if not is_sharded_checkpoint(path):
        return None
    from lightning_mgpu.checkpoint import consolidate

    return consolidate(path)


class _RegisterAfterLightning:
    """A ``sys.meta_path`` finder that finds nothing itself: when ``lightning.pytorch`` is first imported, its
    module runs as usual and then the strategy's names go into Lightning's registry (the finder removes itself at
    that point; nothing of this package is imported then)."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            run(module)
            _register_in(module)

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _register_with_lightning() -> None:
    """Lightning resolves strategy names from its registry, so they are there whenever Lightning is: registered now
    if Lightning is loaded, else right after it loads (a process that never imports Lightning never pays for it)."""
    if _LIGHTNING in sys.modules:
        _register_in(sys.modules[_LIGHTNING])
    elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


_register_with_lightning()
