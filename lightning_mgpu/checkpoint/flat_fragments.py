"""One rank's flat piece of a tensor, written by DCP as the N-d chunks it covers.

Engines that partition flat buffers (DeepSpeed's ZeRO) own, per rank, elements ``[start, start + numel)`` of a
parameter in row-major order: a range that is in general not one N-d box, so not a DTensor shard. Any such range
is a short run of boxes (a partial row, whole rows, a partial row; recursively per dimension, at most
``2 * ndim - 1``), and each box is itself a contiguous run of the range. :class:`FlatFragment` tells DCP's
planner about those boxes (``__create_write_items__``, the hook DTensor implements) and hands out each box as a
view of the rank's own data, so a save writes what the rank owns and nothing else, in the same layout-independent
format as any other checkpoint: one tensor per FQN, its chunks wherever they were cut. Reading picks the pieces
back by box from any layout.

DCP looks an object up by chunk offset only when it is a tensor; :class:`FragmentSavePlanner` (the default
planner otherwise) looks a fragment's box up itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The N-d boxes, in order, that cover elements ``[start, stop)`` of a row-major tensor of ``shape``."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # within one row
        return [((first, *o), (1, *s)) for o, s in boxes(rest, start - first * inner, stop - first * inner)]
    found: list[Box] = []
    whole_from, whole_to = -(-start // inner), stop // inner
    if start % inner:
        found += [((first, *o), (1, *s)) for o, s in boxes(rest, start - first * inner, inner)]
    if whole_to > whole_from:
        found.append(((whole_from, *(0,) * len(rest)), (whole_to - whole_from, *rest)))
    if stop % inner:
        found += [((last, *o), (1, *s)) for o, s in boxes(rest, 0, stop - last * inner)]
    return found


class FlatFragment:
    """Elements ``[start, start + data.numel())`` of a row-major tensor of ``shape``, held by this rank."""

    def __init__(self, shape: tuple[int, ...], data: torch.Tensor, start: int) -> None:
        self.shape = tuple(shape)
        self.data = data.detach().reshape(-1)
        self.start = start
        self._boxes = {offsets: (offsets, sizes) for offsets, sizes in boxes(self.shape, start, start + data.numel())}

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.data)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=properties,
                    size=torch.Size(self.shape),
                ),
            )
            for offsets, sizes in self._boxes.values()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The box at ``index.offset``: a view of this rank's data."""
        assert index.offset is not None
        offsets, sizes = self._boxes[tuple(index.offset)]
        flat = sum(o * math.prod(self.shape[d + 1 :]) for d, o in enumerate(offsets)) - self.start
        return self.data.narrow(0, flat, math.prod(sizes)).view(sizes)

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatFragment:
        """A copy of this rank's elements only (DCP's async staging deep-copies what is not a tensor; copying
        ``data``, a view, would copy the whole flat buffer it views)."""
        return FlatFragment(self.shape, self.data.clone(), self.start)


class FragmentSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds a :class:`FlatFragment`'s boxes by offset."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatFragment):
            return value.__get_tensor_shard__(index)
        return super().lookup_object(index)
