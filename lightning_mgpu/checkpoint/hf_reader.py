"""torch's Hugging Face storage reader, reading each slice with positional reads instead of a memory map.

``HuggingFaceStorageReader`` reads slices through ``safetensors``' memory map: every page a slice touches is mapped
into the process and counted in its resident memory. A column slice of a row-major weight (a row-parallel layer's
shard) touches every page of the weight, so a tensor-parallel rank would map whole weights it holds half of. Here
each slice is read as its contiguous runs (``os.preadv`` into the destination tensor), so a rank's resident memory
grows by the bytes it keeps and nothing more. Planning and metadata are torch's, unchanged.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

# The element types of the safetensors format (its header's "dtype" names).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """One safetensors file's header (where each tensor's bytes are) and positional reads of slices of them."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(size))
        header.pop("__metadata__", None)
        self.tensors = header
        self.data_start = 8 + size

    def read(self, name: str, slices: tuple[slice, ...], into: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor[slices]`` of the stored tensor ``name``, reading only its bytes: straight into ``into`` where it
        is a contiguous CPU tensor of the stored type, else into a new tensor."""
        entry = self.tensors[name]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        starts = [s.start or 0 for s in slices]
        lengths = [(s.stop if s.stop is not None else n) - start for s, n, start in zip(slices, shape, starts)]
        out = torch.empty(lengths, dtype=dtype)
        if into is not None and into.device.type == "cpu" and into.dtype == dtype and into.is_contiguous():
            out = into if list(into.shape) == lengths else out
        if out.numel() == 0:
            return out
        item = out.element_size()
        if not shape:  # a scalar: one element, read as a run of a one-element dimension
            shape, starts, lengths = [1], [0], [1]
        # Dimensions after `cut` are read whole: each run is contiguous in the file and in `out`.
        cut = len(shape) - 1
        while cut > 0 and starts[cut] == 0 and lengths[cut] == shape[cut]:
            cut -= 1
        inner = math.prod(shape[cut + 1 :])
        run_bytes = lengths[cut] * inner * item
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        buffer = memoryview(cast(Any, out.reshape(-1).view(torch.uint8).numpy())).cast("B")
        base = self.data_start + entry["data_offsets"][0]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for run, index in enumerate(_outer_indices(starts[:cut], lengths[:cut])):
                offset = sum(i * s for i, s in zip(index, strides)) + starts[cut] * strides[cut]
                _read_fully(fd, buffer[run * run_bytes : (run + 1) * run_bytes], base + offset * item, self.path)
        finally:
            os.close(fd)
        return out


def _read_fully(fd: int, target: memoryview, offset: int, path: str) -> None:
    """Fill ``target`` from the file's bytes at ``offset`` (one call reads at most ~2 GiB on Linux)."""
    done = 0
    while done < len(target):
        count = os.preadv(fd, [target[done:]], offset + done)
        if count <= 0:
            raise OSError(f"{path} ends before byte {offset + len(target)}: the file is truncated")
        done += count


def _outer_indices(starts: list[int], lengths: list[int]) -> Iterator[tuple[int, ...]]:
    """Every index of the leading dimensions in row-major order (one empty index when there are none)."""
    if not starts:
        yield ()
        return
    for first in range(starts[0], starts[0] + lengths[0]):
        for rest in _outer_indices(starts[1:], lengths[1:]):
            yield (first, *rest)


class HuggingFaceReader(HuggingFaceStorageReader):
    """torch's ``HuggingFaceStorageReader`` whose reads are positional (see the module docstring)."""

    def read_slice(
        self, file: str, name: str, slices: tuple[slice, ...], into: torch.Tensor | None = None
    ) -> torch.Tensor:
        if file not in self._files:
            self._files[file] = SafetensorsFile(file)
        return self._files[file].read(name, slices, into)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        self._files: dict[str, SafetensorsFile] = {}
        for item in plan.items:
            file = self.storage_data[item.storage_index].relative_path
            slices = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
            target = planner.resolve_tensor(item).detach()
            tensor = self.read_slice(file, item.storage_index.fqn, slices, into=target)
            if target.size() != tensor.size():
                raise AssertionError(f"{item.storage_index}: {list(tensor.size())} read, {list(target.size())} wanted")
            if tensor is not target:
                target.copy_(tensor)
            planner.commit_tensor(item, target)
        self._files = {}
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done
