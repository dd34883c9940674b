"""What a checkpoint is on disk, how it is published atomically, and how it is checked before it is read.

Two formats, both keyed by the plain module's FQNs:

- ``"sharded"``: a directory. ``torch.distributed.checkpoint`` (DCP) files hold ``state_dict.<fqn>`` (the model)
  and ``optimizer_states.<i>.state.<fqn>.<name>`` / ``optimizer_states.<i>.param_groups.<fqn>.<hparam>``
  (optimizer ``i`` in DCP's flattened form, which reshards across pipeline stages); ``meta.pt`` holds everything
  else Lightning keeps (loops, callbacks, LR schedulers, precision state, hyperparameters) plus ``parallel_layout``
  and the ``lightning_mgpu`` record (format, RNG states of every rank, optimizer parameter groups by FQN).
- ``"full"`` (the default): one ``torch.save`` file laid out like a single-device Lightning checkpoint
  (``state_dict`` with plain keys, ``optimizer_states`` in torch's own format) plus the same two records, which
  Lightning's own ``LightningModule.load_from_checkpoint`` reads: it opens the path as a file, and no public hook of
  its loader can make it read a directory. The ranks write shards as for a directory; global rank 0 then joins them
  into the file, unless they would not fit in half its free memory (then the directory is published, with a
  warning).

Every save is written beside its target, in ``.<name>.partial``, and renamed into place only when complete; an
interrupted save therefore never replaces or half-writes a checkpoint.

Every file is checksummed, so that damage (a flipped bit on disk or in transit) is refused instead of resumed
into garbage weights: a directory's ``manifest.json``, written last, holds the size and CRC-32 of every other file
(each rank checksums the shards it wrote); a full file is a ``torch.save`` zip archive, whose records carry the
CRC-32 torch computes while writing them. CRC-32 because it is the fastest checksum in the standard library
(zlib's runs at several GB/s, ~5x BLAKE2b) and detects random damage, which is all it guards against.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

FORMAT_VERSION = 2  # 2: a directory has a manifest
METADATA_FILE = "meta.pt"  # Lightning's state beside the shards
DCP_INDEX = ".metadata"  # written by DCP once every rank's shards are on disk
MANIFEST_FILE = "manifest.json"  # size and CRC-32 of every other file, written last
_CHUNK = 16 << 20
MODEL_KEY = "state_dict"
OPTIMIZER_KEY = "optimizer_states"
# A flattened optimizer state's per-parameter keys (torch's `flatten_optimizer_state_dict`): "state.<fqn>.<name>".
STATE_PREFIX = "state."
INFO_KEY = "lightning_mgpu"
LAYOUT_KEY = "parallel_layout"


class LiveModelState(dict):
    """What ``HybridStrategy`` hands Lightning as the model's state dict (empty): the checkpointer writes the live
    module's sharded states wherever the checkpoint hooks leave this object (see ``checkpointer._model_entries``)."""


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt, or does not fit the model/optimizers it is loaded into."""


def partial_path(path: Path) -> Path:
    """Where a save to ``path`` is written before it is published."""
    return path.with_name(f".{path.name}.partial")


def _replaced_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.replaced")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync directories
    finally:
        os.close(fd)


def write_file(obj: object, path: Path) -> None:
    """``torch.save`` and flush to disk."""
    torch.save(obj, path)
    fsync(path)


def publish(finished: Path, path: Path) -> None:
    """Move a finished checkpoint to ``path`` with renames, replacing what is there.

    A directory cannot be renamed over a non-empty one, so a previous checkpoint at ``path`` is first renamed
    aside and deleted after; if the process dies between the two renames, ``load`` names where it is.
    """
    replaced = None
    if path.exists() or path.is_symlink():
        replaced = _replaced_path(path)
        remove(replaced)
        os.replace(path, replaced)
    os.replace(finished, path)
    fsync(path.parent)
    if replaced is not None:
        remove(replaced)


def check_exists(path: Path) -> None:
    if path.exists():
        return
    message = f"Checkpoint {path} does not exist."
    if partial_path(path).exists():
        message += (
            f" An unfinished save was found at {partial_path(path)}: it was interrupted before every rank had"
            " finished writing, and is not loadable. Resume from an earlier checkpoint."
        )
    if _replaced_path(path).exists():
        message += (
            f" The checkpoint previously at this path is at {_replaced_path(path)} (a save was interrupted while"
            " replacing it); rename it back to use it."
        )
    raise FileNotFoundError(message)


def checksum(path: Path) -> dict[str, int | str]:
    """Size and CRC-32 of a file, read in chunks (a file just written comes from the page cache)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as file:
        buffer = bytearray(max(1, min(_CHUNK, os.fstat(file.fileno()).st_size)))  # zero-filling costs too
        view = memoryview(buffer)
        while count := file.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
            size += count
    return {"size": size, "crc32": f"{crc:08x}"}


def write_manifest(directory: Path, records: dict[str, dict[str, int | str]]) -> None:
    """``manifest.json``: the files' records, and a CRC-32 of the manifest's own content."""
    body: dict[str, object] = {"algorithm": "crc32", "files": dict(sorted(records.items()))}
    body["crc32"] = _own_crc(body)
    (directory / MANIFEST_FILE).write_text(json.dumps(body, indent=1))
    fsync(directory / MANIFEST_FILE)


def _own_crc(body: Mapping[str, object]) -> str:
    content = json.dumps({k: v for k, v in body.items() if k != "crc32"}, sort_keys=True)
    return f"{zlib.crc32(content.encode()):08x}"


def _damaged(file: Path, why: str) -> str:
    return f"checkpoint file {file} is damaged: {why}"


def _read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's file records; ``None`` for a directory saved before manifests existed."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        if _manifest_expected(path):
            raise CheckpointError(f"checkpoint file {file} is missing: the checkpoint's files cannot be verified")
        return None
    try:
        body = json.loads(file.read_bytes())
        records = body["files"]
        intact = body["crc32"] == _own_crc(body) and body["algorithm"] == "crc32"
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(_damaged(file, f"unreadable ({type(error).__name__}: {error})")) from None
    if not intact:
        raise CheckpointError(_damaged(file, "crc32 mismatch of its own content"))
    return records


def _manifest_expected(path: Path) -> bool:
    try:
        meta = torch.load(path / METADATA_FILE, map_location="cpu", weights_only=True, mmap=True)
        return meta[INFO_KEY]["format_version"] >= 2
    except Exception:  # unreadable or not ours: the checks after this one say what is wrong
        return False


# How Lightning's ModelParallelStrategy and FSDPStrategy name a sharded checkpoint's entries (``lightning_dirs.py``
# reads them): optimizers as ``optimizer_<i>.state...``/``optimizer_<i>.param_groups...``, FSDPStrategy's model as
# ``model.<fqn>`` (ModelParallelStrategy's as ours).
LIGHTNING_OPTIMIZER = re.compile(r"^optimizer_(\d+)\.(state|param_groups)\.(.+)$")
FSDP_MODEL_PREFIX = "model."


def written_by_lightning(index: Mapping[str, object]) -> bool:
    """Whether a DCP index (``state_dict_metadata``) is that of a Lightning strategy's sharded checkpoint."""
    if any(LIGHTNING_OPTIMIZER.match(key) for key in index):
        return True
    ours = any(key.startswith(f"{MODEL_KEY}.") for key in index)
    return not ours and any(key.startswith(FSDP_MODEL_PREFIX) for key in index)


def verify(path: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """Recompute the checksums of a checkpoint's files (of this rank's share of them); return what is damaged.

    A file that is missing is left to :func:`check_sharded`, which says what it was for. A directory without a
    manifest (saved by an earlier version) is loaded unverified, with a warning.
    """
    if not path.is_dir():
        return _verify_archive(path) if rank == 0 else []
    try:
        records = _read_manifest(path)
    except CheckpointError as error:
        return [str(error)]
    if records is None:
        if rank == 0:
            warnings.warn(f"{path} {_unverified_because(path)}: its files are not verified.", stacklevel=2)
        return []
    problems = []
    for name in sorted(records)[rank::world_size]:
        file, recorded = path / name, records[name]
        if not file.is_file():
            continue
        if file.stat().st_size != recorded["size"]:
            size = file.stat().st_size
            short = "truncated" if size < recorded["size"] else "longer than written"
            problems.append(_damaged(file, f"{short} ({size} of {recorded['size']} bytes)"))
            continue
        found = checksum(file)["crc32"]
        if found != recorded["crc32"]:
            problems.append(_damaged(file, f"crc32 mismatch (recorded {recorded['crc32']}, found {found})"))
    return problems


def _verify_archive(path: Path) -> list[str]:
    """Check the CRC-32 of every record of a ``torch.save`` zip archive (torch's legacy format has none)."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        return []  # not a zip archive: `torch.load` reads the legacy format, or names the file it cannot read
    with archive:
        records = archive.infolist()
        if not any(record.CRC for record in records):
            return []  # written with `torch.serialization.set_crc32_options(False)`
        for record in records:
            try:
                with archive.open(record) as data:
                    while data.read(_CHUNK):
                        pass
            except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
                return [_damaged(path, f"crc32 mismatch or bad header in its record {record.filename!r} ({error})")]
    return []


def check_intact(path: Path) -> None:
    """:func:`verify` every file, in this process; raise naming the damaged ones."""
    problems = verify(path)
    if problems:
        raise CheckpointError(damage_report(problems))


def _written_by_deepspeed(path: Path) -> bool:
    """DeepSpeed's checkpoint layout: a ``latest`` tag file beside ``<tag>/mp_rank_00_model_states.pt``."""
    return (path / "latest").is_file() or any(path.glob("*/mp_rank_*_model_states.pt"))


def _unverified_because(path: Path) -> str:
    try:
        by_lightning = written_by_lightning(FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception:  # an unreadable index: check_sharded names it
        by_lightning = False
    if by_lightning:
        return "was written by a Lightning strategy (ModelParallelStrategy, FSDPStrategy), which records no checksums"
    return f"has no {MANIFEST_FILE} (saved by an earlier version)"


def damage_report(problems: list[str]) -> str:
    """One message for the damage found (the first problem in full), saying that nothing was loaded."""
    more = f" (and {len(problems) - 1} more: {', '.join(problems[1:3])})" if len(problems) > 1 else ""
    return f"{problems[0]}{more}. It was not loaded; use another checkpoint."


def check_sharded(path: Path) -> Metadata:
    """Check that every file a sharded checkpoint needs is there and long enough; return DCP's index."""
    if not (path / DCP_INDEX).is_file() and _written_by_deepspeed(path):
        raise CheckpointError(
            f"{path} is a DeepSpeed checkpoint (Lightning's DeepSpeedStrategy writes them), which HybridStrategy"
            " does not read (its zero_backend='deepspeed' writes this package's format). Convert its weights to one"
            " file with Lightning's `lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict("
            "checkpoint_dir, 'weights.ckpt')` and start from it with HybridStrategy(pretrained='weights.ckpt'); its"
            " optimizer states do not carry over."
        )
    problems = []
    if not (path / METADATA_FILE).is_file():
        problems.append(f"{METADATA_FILE} (the trainer state, written by global rank 0 after the shards)")
    metadata = None
    if not (path / DCP_INDEX).is_file():
        problems.append(f"{DCP_INDEX} (DCP's index of the shards, written once every rank has finished)")
    else:
        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as error:  # a truncated pickle raises anything from EOFError to UnpicklingError
            problems.append(f"{DCP_INDEX} is unreadable ({type(error).__name__}: {error})")
    if metadata is not None:
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            file = path / name
            if not file.is_file():
                problems.append(f"{name} (a data shard)")
            elif file.stat().st_size < size:
                problems.append(f"{name} is truncated ({file.stat().st_size} of at least {size} bytes)")
    if problems:
        raise CheckpointError(
            f"The sharded checkpoint {path} is incomplete or corrupt; missing or damaged: {'; '.join(problems)}."
        )
    assert metadata is not None
    return metadata


def state_bytes(path: Path) -> int:
    """The bytes of every tensor a DCP directory holds, whole (what joining its shards into one file holds)."""
    metadata = FileSystemReader(path).read_metadata()
    return sum(
        entry.size.numel() * entry.properties.dtype.itemsize
        for entry in metadata.state_dict_metadata.values()
        if isinstance(entry, TensorStorageMetadata)
    )


def free_memory_bytes() -> int | None:
    """This host's available memory (``MemAvailable`` of ``/proc/meminfo``, else free pages), ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def load_file(path: Path, weights_only: bool | None = None) -> Any:
    """``torch.load`` on CPU, memory-mapped where possible, naming the file when it is damaged."""
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        raise CheckpointError(_unpickling_problem(path, error, weights_only)) from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as error:
        raise CheckpointError(f"{path} could not be read, it is truncated or corrupt: {error}") from error


def _unpickling_problem(path: Path, error: Exception, weights_only: bool | None) -> str:
    """Why ``torch.load`` refused ``path``: not a torch file at all, or one holding objects weights-only loading
    refuses (which the user may allow for a file they trust)."""
    with open(path, "rb") as file:
        head = file.read(2)
    if not zipfile.is_zipfile(path) and head[:1] != b"\x80":  # neither torch's zip format nor a pickle
        return (
            f"{path} is not a checkpoint (torch.load cannot read it). Give a sharded checkpoint directory or a file"
            " written by torch.save or Trainer.save_checkpoint."
        )
    if weights_only is not False:
        reason = (str(error).strip().splitlines() or [""])[-1]
        return (
            f"{path} holds objects that weights-only loading refuses ({reason}). If you trust the file, load it with"
            " weights_only=False (the command line's --trust)."
        )
    return f"{path} could not be unpickled, it is truncated or corrupt: {error}"


def read_metadata(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """A checkpoint's metadata: ``meta.pt`` of a (checked) directory, or the whole of a full file."""
    check_exists(path)
    check_intact(path)
    if path.is_dir():
        check_sharded(path)
        return load_file(path / METADATA_FILE, weights_only)
    return load_file(path, weights_only)


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).is_file()


class FlatReader(StorageReader):
    """Serves DCP loads from full tensors in memory (a ``"full"`` file), so that loading a full file reshards
    into whatever layout the model has exactly as loading a sharded directory does."""

    def __init__(self, flat: dict[str, Any]) -> None:
        super().__init__()
        self.flat = flat
        entries: dict[str, STORAGE_TYPES] = {}
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.size())
                entries[key] = TensorStorageMetadata(TensorProperties.create_from_tensor(value), value.size(), [chunk])
            else:
                entries[key] = BytesStorageMetadata()
        self.metadata = Metadata(state_dict_metadata=entries)

    def reset(self, checkpoint_id: object = None) -> None:
        pass

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        for item in plan.items:
            value = self.flat[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(value, buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                value = value.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(value)
            planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: object) -> bool:
        return False
