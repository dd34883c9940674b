"""Buffers broadcast from the first data-parallel rank before a forward, as DDP does.

Lightning's ``DDPStrategy`` runs torch's ``DistributedDataParallel`` with ``broadcast_buffers=True``: before a forward
that follows a forward with gradients (every training step, and the first evaluation step after one), every rank
takes the first rank's buffers, so BatchNorm's running statistics agree on every rank and evaluation uses rank 0's.
torch's composable ``replicate`` builds its DDP over the parameters alone and FSDP2 never syncs buffers: each rank
kept the statistics of its own batches (validation metrics differed from DDP's, checkpoints held rank 0's). The
root broadcasts its persistent buffers (those a checkpoint holds, such as running statistics) under DDP's rule;
non-persistent ones (causal masks, rotary frequencies) are built alike on every rank and not sent.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu._compat.tensors import persistent_buffer_names

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Roots whose gradient reduction is off (the non-final micro-steps of gradient accumulation), set by
# `set_gradient_sync`: DDP sends no buffers after a forward under `no_sync`.
_NOT_SYNCING: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# Pipeline stages inside a training step's schedule: broadcast before its first microbatch only (see `once_per_step`).
_IN_SCHEDULE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_BROADCASTS: weakref.WeakKeyDictionary[nn.Module, BufferBroadcast] = weakref.WeakKeyDictionary()


def note_gradient_sync(root: nn.Module, enabled: bool) -> None:
    if enabled:
        _NOT_SYNCING.discard(root)
    else:
        _NOT_SYNCING.add(root)


class BufferBroadcast:
    """Forward hooks on a data-parallel root: DDP broadcasts before a forward that follows one with gradients
    enabled and their reduction on."""

    def __init__(self, root: nn.Module, group: ProcessGroup) -> None:
        self.root = root
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.names = persistent_buffer_names(root)
        self.pending = True  # DDP's first forward broadcasts too
        _BROADCASTS[root] = self
        root.register_forward_pre_hook(self._before, prepend=True)
        root.register_forward_hook(self._after)

    def _before(self, module: nn.Module, args: Any) -> None:
        if not self.pending:
            return
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        for name in self.names:
            buffer = self.root.get_buffer(name)  # looked up each time: a callback may assign a new tensor
            by_kind[buffer.dtype, buffer.device].append(buffer)
        with torch.no_grad():
            for buffers in by_kind.values():  # one broadcast per dtype
                flat = torch.cat([b.reshape(-1) for b in buffers])
                dist.broadcast(flat, self.src, group=self.group)
                for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
                    buffer.copy_(value.view_as(buffer))

    def _after(self, module: nn.Module, args: Any, output: object) -> None:
        self.pending = torch.is_grad_enabled() and module not in _NOT_SYNCING and module not in _IN_SCHEDULE


@contextmanager
def once_per_step(stages: Iterable[nn.Module]) -> Generator[None, None, None]:
    """A pipeline schedule's training step: the stages' buffers are broadcast before the first microbatch's forward
    only, as DDP does once per step. Before the later ones, earlier microbatches' backwards are pending, and a
    BatchNorm saved its running statistics for them: an in-place write would fail that backward."""
    stages = list(stages)
    _IN_SCHEDULE.update(stages)
    try:
        yield
    finally:
        for stage in stages:
            _IN_SCHEDULE.discard(stage)
            if stage in _BROADCASTS:
                _BROADCASTS[stage].pending = stage not in _NOT_SYNCING


def broadcast_buffers_like_ddp(root: nn.Module, group: ProcessGroup) -> None:
    """Give ``root`` DDP's buffer broadcast over ``group`` (nothing to do for one rank or no persistent buffer)."""
    if dist.get_world_size(group) > 1 and persistent_buffer_names(root):
        BufferBroadcast(root, group)
