"""Writing one checkpoint file tensor by tensor: the process holds the largest tensor, never the whole model.

A torch file is first saved as a skeleton, its tensors fake (``torch.serialization.skip_data``: the structure and
every record's place, no bytes), then each tensor's bytes are read from the source (``fill``) and written into its
record in place. A safetensors file is its header (names, types, shapes and offsets, all known from the source's
metadata) followed by the tensors' bytes in order. Either way a tensor is read, written and dropped before the
next one is read.
"""

from __future__ import annotations

import json
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from lightning_mgpu._compat.tensors import fake_tensor_mode

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class Leaf:
    """A tensor of the file to write, by the name its source knows it under."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


Fill = Callable[[Leaf], torch.Tensor]


def write_torch(out: Path, skeleton: Any, fill: Fill) -> int:
    """``torch.save(skeleton)`` with each ``Leaf`` in it replaced by ``fill(leaf)``, read one at a time; returns the
    number of tensors written."""
    leaves: list[Leaf] = []
    kept: dict[Leaf, torch.Tensor] = {}  # tensors already in the skeleton (RNG states, small metadata)
    skeleton = _tensors_as_leaves(skeleton, kept)
    with fake_tensor_mode():
        fakes = _replace_leaves(skeleton, leaves, lambda leaf: torch.empty(leaf.shape, dtype=leaf.dtype))
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fakes, out)
    records = _storage_records(out)
    if len(records) != len(leaves):
        raise RuntimeError(f"{out}: {len(records)} storage records for {len(leaves)} tensors")
    with open(out, "r+b") as file:
        for leaf, record in zip(leaves, records):
            if record.size != leaf.nbytes:
                raise RuntimeError(
                    f"{out}: the record of {leaf.key} holds {record.size} bytes, the tensor {leaf.nbytes}"
                )
            data = _bytes(kept[leaf] if leaf in kept else fill(leaf))
            file.seek(record.offset)
            file.write(data)
            _set_crc(file, record, zlib.crc32(data))
    return len(leaves)


def write_safetensors(out: Path, leaves: dict[str, Leaf], fill: Fill, metadata: dict[str, str] | None = None) -> int:
    """A safetensors file of ``leaves`` (``{name in the file: leaf}``), each filled by ``fill``, one at a time."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, leaf in leaves.items():
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[leaf.dtype],
            "shape": list(leaf.shape),
            "data_offsets": [offset, offset + leaf.nbytes],
        }
        offset += leaf.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(out, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for leaf in leaves.values():
            file.write(_bytes(fill(leaf)))
    return len(leaves)


def _tensors_as_leaves(value: object, kept: dict[Leaf, torch.Tensor]) -> Any:
    """``value`` with its real tensors made leaves too (kept aside), so that every storage record is a leaf's."""
    if isinstance(value, torch.Tensor):
        leaf = Leaf(f"<kept {len(kept)}>", tuple(value.shape), value.dtype)
        kept[leaf] = value
        return leaf
    if isinstance(value, dict):
        return {k: _tensors_as_leaves(v, kept) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors_as_leaves(v, kept) for v in value)
    return value


def _replace_leaves(value: object, found: list[Leaf], make: Callable[[Leaf], Any]) -> Any:
    """``value`` with every ``Leaf`` made a tensor, the leaves listed in the order ``pickle`` will meet them."""
    if isinstance(value, Leaf):
        found.append(value)
        return make(value)
    if isinstance(value, dict):
        return {k: _replace_leaves(v, found, make) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_leaves(v, found, make) for v in value]
    if isinstance(value, tuple):
        return tuple(_replace_leaves(v, found, make) for v in value)
    return value


@dataclass(frozen=True)
class _Record:
    """Where a storage record's bytes and its CRC-32 fields are in a torch file (a zip archive)."""

    offset: int  # of the data
    size: int
    central_crc: int  # the CRC field of its central directory entry


def _storage_records(path: Path) -> list[_Record]:
    """The storage records of a torch file (``<archive>/data/<n>``), by ``n``."""
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        central = _central_crc_offsets(raw, archive.start_dir, len(archive.infolist()))
        records = []
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                raw.seek(info.header_offset + 26)
                name_length, extra_length = struct.unpack("<HH", raw.read(4))
                offset = info.header_offset + 30 + name_length + extra_length
                records.append((int(parts[2]), _Record(offset, info.file_size, central[info.filename])))
    return [record for _, record in sorted(records, key=lambda item: item[0])]


def _central_crc_offsets(raw: Any, start: int, count: int) -> dict[str, int]:
    """Each entry's CRC field in the zip central directory (at 16 bytes into its 46-byte fixed part)."""
    found = {}
    raw.seek(start)
    for _ in range(count):
        position = raw.tell()
        fixed = raw.read(46)
        name_length, extra_length, comment_length = struct.unpack("<HHH", fixed[28:34])
        name = raw.read(name_length).decode()
        raw.seek(extra_length + comment_length, 1)
        found[name] = position + 16
    return found


def _set_crc(file: Any, record: _Record, crc: int) -> None:
    """The CRC-32 of the bytes written, where the skeleton's save put the CRC of its empty record: the data
    descriptor after the data (torch writes one, with its optional signature) and the central directory."""
    packed = struct.pack("<I", crc)
    file.seek(record.offset + record.size)
    signature = file.read(4) == b"PK\x07\x08"
    file.seek(record.offset + record.size + (4 if signature else 0))
    file.write(packed)
    file.seek(record.central_crc)
    file.write(packed)


def _bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(cast(Any, flat.numpy()))


def iterate_leaves(value: object) -> Iterator[Leaf]:
    """Every ``Leaf`` in a nested structure."""
    if isinstance(value, Leaf):
        yield value
    elif isinstance(value, dict):
        for inner in value.values():
            yield from iterate_leaves(inner)
    elif isinstance(value, (list, tuple)):
        for inner in value:
            yield from iterate_leaves(inner)
