"""A vocabulary-parallel embedding whose lookup is reduced where it happens, not when its module returns.

torch's ``RowwiseParallel`` on an ``nn.Embedding`` leaves the lookup a DTensor in a ``_MaskPartial`` placement (each
rank holds the rows of its vocabulary shard, zeros elsewhere, plus the mask of the indices it does not own) and
reduces it in the module's output hook. That is only correct when the lookup is the module's whole forward. Many
embeddings do more inside their own forward: Gemma's ``embed * normalizer``, Muse's ``embed_norm(embed)``. There the
masked partial value meets ordinary code, and torch's mask cannot serve it:

- the mask is released by the first reduction, so a lookup read twice (an RMSNorm squares its input and then
  scales it) fails at the second reduction (``_reduce_value``: ``AssertionError``);
- the placement, and with it the mask, comes from torch's sharding-propagation cache, shared by every lookup with
  the same shapes in the process (and inherited by forked children): a lookup left unreduced when an op fails
  keeps the shared mask materialized, and every later lookup of those shapes fails ("MaskBuffer has been
  materialized with conflicting data").

``VocabParallelEmbedding`` reduces each lookup (all-reduce, or reduce-scatter to the sequence shard under sequence
parallelism) right where ``F.embedding`` returns, inside the module's forward, so the code after it sees the layout
of the residual stream, exactly what the output hook hands on, and no masked value outlives the lookup.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_mgpu._compat.dtensor import StyleHooks

_LOOKUPS = (F.embedding, torch.embedding)


class _ReducedLookups(TorchFunctionMode):
    """While an embedding module's forward runs: each partial lookup result is redistributed to ``placements``."""

    def __init__(self, placements: tuple) -> None:
        super().__init__()
        self.placements = placements

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in _LOOKUPS and isinstance(result, DTensor) and any(isinstance(p, Partial) for p in result.placements):
            return result.redistribute(placements=self.placements)
        return result


def reduce_lookups_in_forward(module: nn.Module, placements: tuple) -> nn.Module:
    """Reduce every partial lookup of ``module`` (a vocabulary-sharded embedding) to ``placements`` inside its
    forward: a ``_ReducedLookups`` mode from its forward pre-hook to its forward hook."""
    active: list[_ReducedLookups] = []

    def enter(mod: nn.Module, args: Any) -> None:
        mode = _ReducedLookups(placements)
        mode.__enter__()
        active.append(mode)

    def leave(mod: nn.Module, args: Any, output: object) -> None:
        if active:  # always called, also when the forward raised: the mode never outlives it
            active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return module


class VocabParallelEmbedding(StyleHooks, RowwiseParallel):
    """torch's row-wise (vocabulary-parallel) embedding, its lookups reduced inside the module's forward."""

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return reduce_lookups_in_forward(super().apply_style(module, device_mesh), self.output_layouts)
