"""One rank's flat piece of a tensor, written by DCP as the N-d chunks it covers.

Engines that partition flat buffers (DeepSpeed's ZeRO) own, per rank, elements ``[start, start + numel)`` of a
parameter in row-major order: a range that is in general not one N-d box, so not a DTensor shard. Any such range
is a short run of boxes (a partial row, whole rows, a partial row; recursively per dimension, at most
``2 * ndim - 1``), and each box is itself a contiguous run of the range. :class:`FlatFragment` tells DCP's
planner about those boxes (``__create_write_items__``, the hook DTensor implements) and hands out each box as a
view of the rank's own data, so a save writes what the rank owns and nothing else, in the same layout-independent
format as any other checkpoint: one tensor per FQN, its chunks wherever they were cut.

A load reads into the same boxes (``__create_chunk_list__``): DCP copies each from whichever saved chunks overlap
it, straight into the rank's data. DCP looks an object up by chunk offset only when it is a tensor;
:class:`FragmentSavePlanner` and :class:`FragmentLoadPlanner` (the default planners otherwise) look a fragment's
box up themselves.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
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

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
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

    def size(self) -> torch.Size:  # the whole tensor's, which DCP checks against the checkpoint's before a load
        return torch.Size(self.shape)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The boxes, for a load: DCP reads each from whichever saved chunks overlap it."""
        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
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


class BoxFragment:
    """One N-d box of a checkpoint tensor of ``shape``, at ``offsets``, read straight into ``data`` (a view of a
    rank's own tensor: a converted entry's piece, such as one expert's slice of a stacked expert weight)."""

    def __init__(self, shape: tuple[int, ...], data: torch.Tensor, offsets: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.data = data
        self.offsets = tuple(offsets)

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.data.size())]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.data


Fragment = FlatFragment | BoxFragment


class FragmentSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds a :class:`FlatFragment`'s boxes by offset."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatFragment):
            return value.__get_tensor_shard__(index)
        return super().lookup_object(index)


class FragmentLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also reads into a :class:`FlatFragment`'s or :class:`BoxFragment`'s boxes
    (views of the rank's own data: a load writes straight into the partitions the fragment views). Its set-up
    replaces every value that is not a tensor or a plain object by ``None``; fragments are kept aside and put back."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        kept = _take_fragments(state_dict, ())
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, (container, key, fragment) in kept.items():
            container[key] = fragment
            self.state_dict[".".join(path) if self.flatten_state_dict else path[-1]] = fragment

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, (FlatFragment, BoxFragment)):
            return value.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


def _take_fragments(value: Any, path: tuple[str, ...]) -> dict[tuple[str, ...], tuple[Any, Any, Fragment]]:
    """Every fragment in a nested state dict by its path, each replaced by ``None`` in its container."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    kept = {}
    for key, item in list(items):
        if isinstance(item, (FlatFragment, BoxFragment)):
            kept[(*path, str(key))] = (value, key, item)
            value[key] = None
        else:
            kept |= _take_fragments(item, (*path, str(key)))
    return kept
