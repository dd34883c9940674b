"""Pretrained weights read into a parallelized model: each rank reads only the slices it holds.

A source (:func:`open_weights`) is a Hugging Face directory (``model.safetensors``, or shards listed in
``model.safetensors.index.json``: torch's ``HuggingFaceStorageReader`` reads slices of them), one of our sharded
checkpoints (a DCP directory) or a consolidated torch/Lightning file (memory-mapped). Planning reads headers only
(:func:`map_weights`): checkpoint names are matched to the model's state-dict names through the pair of prefixes
under which most of them agree (the Hugging Face model's attribute in the LightningModule, a base model inside a
task model), then the Hugging Face model's own conversions (per-expert tensors stacked into one fused weight,
renamed legacy names); missing, unexpected and mismatched entries are named before any tensor is read.
:func:`load_weights` then asks DCP for each rank's own slices: a tensor split over tensor parallelism, a pipeline
stage's blocks, a ZeRO-3 shard, an expert range.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

from lightning_mgpu._compat.dtensor import local_box
from lightning_mgpu.checkpoint.flat_fragments import BoxFragment, FragmentLoadPlanner
from lightning_mgpu.checkpoint.format import METADATA_FILE, MODEL_KEY, CheckpointError, FlatReader, load_file
from lightning_mgpu.checkpoint.hf_reader import HuggingFaceReader
from lightning_mgpu.checkpoint.states import by_block, describable, some

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HF_INDEX = "model.safetensors.index.json"


@dataclass
class WeightsSource:
    """Where pretrained weights come from, and the shape of each of its tensors (read from headers only)."""

    path: Path
    kind: str  # "Hugging Face", "sharded" or "torch file"
    entries: dict[str, tuple[int, ...]]
    dcp_prefix: str = ""  # a name's key in the DCP reader: our sharded checkpoints keep the model under MODEL_KEY
    _flat: dict[str, Any] | None = None

    def reader(self) -> StorageReader:
        if self.kind == "Hugging Face":
            return HuggingFaceReader(str(self.path))
        if self.kind == "sharded":
            return FileSystemReader(self.path)
        assert self._flat is not None
        return FlatReader(self._flat)

    def bytes_of(self, names: set[str] | None = None) -> int:
        """The checkpoint's tensor bytes (of ``names``), for reports; 4 bytes an element where the dtype is unknown."""
        return sum(4 * _numel(shape) for name, shape in self.entries.items() if names is None or name in names)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def open_weights(path: str | Path) -> WeightsSource:
    """The weights at ``path``, their names and shapes read from headers; no tensor data is read."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"pretrained={str(path)!r}: no such file or directory.")
    if path.is_file() and path.suffix == ".safetensors":
        siblings = sorted(path.parent.glob("*.safetensors"))
        if siblings != [path]:
            raise CheckpointError(
                f"pretrained={str(path)!r} is one file of {len(siblings)} safetensors files in {path.parent}: pass the"
                " directory (a Hugging Face model directory holds its shards and their index)."
            )
        path = path.parent
    if path.is_dir():
        if (path / METADATA_FILE).is_file():
            return _sharded(path)
        if any(path.glob("*.safetensors")):
            return _hugging_face(path)
        raise CheckpointError(
            f"pretrained={str(path)!r} holds neither *.safetensors files (a Hugging Face model directory) nor a"
            f" lightning-mgpu sharded checkpoint ({METADATA_FILE} beside its shards)."
        )
    return _torch_file(path)


def _hugging_face(path: Path) -> WeightsSource:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    index = path / HF_INDEX
    if index.is_file():
        import json

        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        absent = sorted(name for name in listed if not (path / name).is_file())
        if absent:
            raise CheckpointError(f"pretrained={str(path)!r}: {HF_INDEX} lists shards that are missing: {absent}.")
    metadata = HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
    return WeightsSource(path, "Hugging Face", _shapes(metadata))


def _sharded(path: Path) -> WeightsSource:
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = f"{MODEL_KEY}."
    entries = {key[len(prefix) :]: shape for key, shape in _shapes(metadata).items() if key.startswith(prefix)}
    return WeightsSource(path, "sharded", entries, dcp_prefix=prefix)


def _torch_file(path: Path) -> WeightsSource:
    loaded = load_file(path)  # memory-mapped: only the pages a rank's slices cover are read
    state = loaded.get(MODEL_KEY, loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"pretrained={str(path)!r} is neither a state dict nor a Lightning checkpoint (a dict with"
            f" '{MODEL_KEY}'): it holds {type(loaded).__name__}."
        )
    flat = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    return WeightsSource(path, "torch file", {k: tuple(v.shape) for k, v in flat.items()}, _flat=flat)


def _shapes(metadata: Mapping[str, object]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(md.size) for key, md in metadata.items() if isinstance(md, TensorStorageMetadata)}


# --------------------------------------------------------------------------------------------------- name mapping
@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's place inside a model tensor assembled from several (Hugging Face conversions)."""

    name: str  # the checkpoint's
    offsets: tuple[int, ...]  # in the model tensor
    sizes: tuple[int, ...]  # in the model tensor (1 along ``stack_dim``)
    stack_dim: int | None  # the model tensor's dimension the checkpoint tensor lacks (stacked experts)


@dataclass
class WeightMap:
    """Which checkpoint entries fill which model entries (state-dict names)."""

    direct: dict[str, str] = field(default_factory=dict)
    parts: dict[str, list[Part]] = field(default_factory=dict)
    prefixes: tuple[str, str] = ("", "")  # (model, checkpoint) prefix pair the names matched under
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def loaded(self) -> set[str]:
        return set(self.direct) | set(self.parts)

    def describe(self) -> str:
        model, checkpoint = self.prefixes
        rename = f" ('{checkpoint}' -> '{model}')" if model != checkpoint else ""
        line = f"{len(self.direct) + len(self.parts)} model entries from the checkpoint{rename}"
        if self.parts:
            line += f", {len(self.parts)} of them assembled from several checkpoint tensors"
        if self.missing:
            line += f"; not in it (initialized): {some(self.missing)}"
        if self.unexpected:
            line += f"; not in the model (ignored): {some(self.unexpected)}"
        return line


def map_weights(module: nn.Module, source: WeightsSource, strict: bool = True, where: str = "") -> WeightMap:
    """Match ``source``'s entries to ``module``'s state dict, from names and shapes only (the module may be on the
    meta device). Raises :class:`CheckpointError` for mismatched shapes and, when ``strict``, for entries either
    side lacks, naming them."""
    where = where or f"pretrained={str(source.path)!r}"
    shapes = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    entries = source.entries
    model_prefix, checkpoint_prefix = _best_prefixes(shapes, entries)
    weights = WeightMap(prefixes=(model_prefix, checkpoint_prefix))
    for key in shapes:
        plain = unwrapped(key)
        name = checkpoint_prefix + plain[len(model_prefix) :]
        if plain.startswith(model_prefix) and name in entries:
            weights.direct[key] = name
    used = set(weights.direct.values())
    unsupported = _hugging_face_conversions(module, shapes, entries, used, weights)
    _follow_ties(module, weights)
    used = set(weights.direct.values()) | {part.name for parts in weights.parts.values() for part in parts}
    weights.missing = [key for key in shapes if key not in weights.direct and key not in weights.parts]
    weights.unexpected = [name for name in entries if name not in used]
    mismatched = [
        f"{key} is {list(shapes[key])} in the model, {list(entries[name])} in the checkpoint"
        for key, name in weights.direct.items()
        if shapes[key] != entries[name]
    ]
    mismatched += _assembly_mismatches(weights, shapes, entries)
    problems = []
    if unsupported:
        problems.append(f"entries need Hugging Face conversions this loader does not perform: {some(unsupported, 4)}")
    if mismatched:
        problems.append(f"shapes differ: {some(mismatched, 4)}")
    if strict and weights.missing:
        problems.append(
            f"it has no entry for {len(weights.missing)} of the model's {len(shapes)} parameters and buffers:"
            f" {some(by_block(weights.missing, list(shapes)))}"
        )
    if strict and weights.unexpected:
        problems.append(
            f"it has {len(weights.unexpected)} entries the model does not have:"
            f" {some(by_block(weights.unexpected, list(entries)))}"
        )
    if problems:
        fix = " (pretrained_strict=False loads the entries both have and initializes the rest)" if strict else ""
        raise CheckpointError(f"{where} does not fit the model: {'; '.join(problems)}{fix}.")
    return weights


# Attributes through which wrappers hold the module they wrap: the weights are the wrapped module's (peft's LoRA
# layers, torch.compile, torch's activation-checkpoint wrapper).
_WRAPPER_ATTRIBUTES = ("base_layer", "_orig_mod", "_checkpoint_wrapped_module")


def unwrapped(name: str) -> str:
    """``name`` without the wrappers' attributes (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_ATTRIBUTES)


def _best_prefixes(shapes: dict[str, tuple[int, ...]], entries: dict[str, tuple[int, ...]]) -> tuple[str, str]:
    """The (model, checkpoint) prefixes under which most names agree: ``model.`` for a Hugging Face model held as
    ``self.model``; ``model.bert.`` for a base model's checkpoint inside a task model; ``''`` for our own."""
    checkpoint_prefixes = {""}
    checkpoint_prefixes |= {_prefix(name, depth) for name in entries for depth in (1, 2) if name.count(".") >= depth}
    scores: dict[tuple[str, str], int] = defaultdict(int)
    for key in shapes:
        parts = unwrapped(key).split(".")
        for depth in range(len(parts)):
            model_prefix = ".".join(parts[:depth]) + "." if depth else ""
            rest = unwrapped(key)[len(model_prefix) :]
            for checkpoint_prefix in checkpoint_prefixes:
                if checkpoint_prefix + rest in entries:
                    scores[(model_prefix, checkpoint_prefix)] += 1
    if not scores:
        return "", ""
    return max(scores, key=lambda pair: (scores[pair], -len(pair[0]) - len(pair[1])))


def _prefix(name: str, depth: int) -> str:
    return ".".join(name.split(".")[:depth]) + "."


def _hugging_face_conversions(
    module: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    entries: dict[str, tuple[int, ...]],
    used: set[str],
    weights: WeightMap,
) -> list[str]:
    """Checkpoint entries that the Hugging Face model's own conversion mapping renames or assembles (what
    ``from_pretrained`` does to them), added to ``weights``; returns those needing an operation not performed."""
    model_prefix, checkpoint_prefix = weights.prefixes
    hf = _hugging_face_model(module, model_prefix)
    rest = [name for name in entries if name not in used and name.startswith(checkpoint_prefix)]
    if hf is None or not rest:
        return []
    hf_prefix, hf_model = hf
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    inside = model_prefix[len(hf_prefix) :]  # the checkpoint's root, seen from the Hugging Face model
    pieces: dict[str, list[tuple[Any, int, int, str]]] = defaultdict(list)
    unsupported = []
    for name in rest:
        relative = inside + name[len(checkpoint_prefix) :]
        renamed, pattern = rename_source_key(relative, renamings, converters)
        key = hf_prefix + renamed
        if key not in shapes:
            continue
        if pattern is None:
            weights.direct[key] = name
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        index = _list_index(pattern, relative)
        if not _assembles(converter) or (index is None and _merges(converter)):
            unsupported.append(f"{name} ({' + '.join(type(op).__name__ for op in converter.operations)})")
            continue
        pieces[key].append((converter, converter.source_patterns.index(pattern), index or 0, name))
    for key, found in pieces.items():
        weights.parts[key] = _place_parts(found, entries)
    return unsupported


def _hugging_face_model(module: nn.Module, model_prefix: str) -> tuple[str, PreTrainedModel] | None:
    """The outermost ``PreTrainedModel`` holding the names under ``model_prefix`` (or the one below it)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    found = [(f"{n}." if n else "", sub) for n, sub in module.named_modules() if isinstance(sub, PreTrainedModel)]
    above = [(prefix, sub) for prefix, sub in found if model_prefix.startswith(prefix)]
    if above:
        return min(above, key=lambda pair: len(pair[0]))
    below = [(prefix, sub) for prefix, sub in found if prefix.startswith(model_prefix)]
    outermost = [pair for pair in below if not any(pair[0] != p and pair[0].startswith(p) for p, _ in below)]
    return outermost[0] if len(outermost) == 1 else None


def _merges(converter: Any) -> bool:
    return any(type(op).__name__ == "MergeModulelist" for op in converter.operations)


def _assembles(converter: Any) -> bool:
    """Operations this loader performs by reading slices: stacking a module list, concatenating."""
    names = [type(op).__name__ for op in converter.operations]
    return names in (["MergeModulelist"], ["Concatenate"], ["MergeModulelist", "Concatenate"])


def _list_index(pattern: str, name: str) -> int | None:
    """The module-list index a ``*`` of ``pattern`` stands for in ``name`` (``experts.3.up_proj.weight``: 3)."""
    if "*" not in pattern:
        return None
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)
    return int(found.group(1)) if found else None


def _place_parts(found: list[tuple[Any, int, int, str]], entries: dict[str, tuple[int, ...]]) -> list[Part]:
    """Where each piece of one assembled tensor goes: stacked along the module list's dimension, concatenated
    along the concatenation's (sources in the converter's order, list entries in index order)."""
    converter = found[0][0]
    stack_dim = next((op.dim for op in converter.operations if type(op).__name__ == "MergeModulelist"), None)
    cat_dim = next((op.dim for op in converter.operations if type(op).__name__ == "Concatenate"), None)
    parts = []
    start = 0
    for source in sorted({source for _, source, _, _ in found}):
        pieces = sorted((index, name) for _, s, index, name in found if s == source)
        width = 0
        for index, name in pieces:
            shape = list(entries[name])
            if stack_dim is not None:
                shape.insert(stack_dim, 1)
            offsets = [0] * len(shape)
            if stack_dim is not None:
                offsets[stack_dim] = index
            if cat_dim is not None:
                offsets[cat_dim] = start
                width = shape[cat_dim]
            parts.append(Part(name, tuple(offsets), tuple(shape), stack_dim))
        start += width
    return parts


def _assembly_mismatches(
    weights: WeightMap, shapes: dict[str, tuple[int, ...]], entries: dict[str, tuple[int, ...]]
) -> list[str]:
    """Assembled tensors whose pieces do not cover the model tensor exactly once."""
    wrong = []
    for key, parts in weights.parts.items():
        shape = shapes[key]
        covered = sum(_numel(part.sizes) for part in parts)
        inside = all(o + s <= d for part in parts for o, s, d in zip(part.offsets, part.sizes, shape))
        if covered != _numel(shape) or not inside or any(len(part.sizes) != len(shape) for part in parts):
            wrong.append(f"{key} is {list(shape)} in the model, assembled from {len(parts)} checkpoint tensors")
    return wrong


def _follow_ties(module: nn.Module, weights: WeightMap) -> None:
    """A model entry absent from the checkpoint takes the entry of the parameter it is tied to (Hugging Face saves
    a tied head once, under the embedding's name)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    for tied in names.values():
        source = next((n for n in tied if n in weights.direct), None)
        for name in tied:
            if source is not None and name not in weights.direct:
                weights.direct[name] = weights.direct[source]


# -------------------------------------------------------------------------------------------------------- loading
@torch.no_grad()
def load_weights(module: nn.Module, source: WeightsSource, weights: WeightMap) -> None:
    """Fill ``module`` (parallelized and materialized) from ``source`` as ``weights`` maps it: each rank reads the
    slices of the tensors it holds and nothing else. Collective over every rank."""
    reads = _Reads(module, source, weights)
    try:
        # Each rank plans and reads its own slices: no global plan to agree on (no collective).
        dcp.load(reads.request, storage_reader=source.reader(), planner=FragmentLoadPlanner(), no_dist=True)
    except Exception as error:
        raise CheckpointError(f"Reading pretrained={str(source.path)!r} failed: {error}") from error
    for value, name in reads.twice:
        value.copy_(reads.request[name])
    converted = {key: value for key, value in reads.described.items() if value is not reads.state[key]}
    if converted:
        module.load_state_dict(converted, strict=False)


def planned_read_bytes(module: nn.Module, source: WeightsSource, weights: WeightMap) -> int:
    """The bytes this rank of a parallelized ``module`` would read from ``source`` (DCP's own read plan, from the
    checkpoint's headers: nothing is read). Raises where a slice cannot be read (shapes that do not fit)."""
    reads = _Reads(module, source, weights)
    metadata = source.reader().read_metadata()
    planner = FragmentLoadPlanner()
    planner.set_up_planner(reads.request, metadata, is_coordinator=False)
    total = 0
    for item in planner.create_local_plan().items:
        entry = metadata.state_dict_metadata[item.storage_index.fqn]
        dtype = getattr(getattr(entry, "properties", None), "dtype", torch.float32)
        total += _numel(tuple(item.lengths)) * torch.empty((), dtype=dtype).element_size()
    return total


class _Reads:
    """What one rank asks DCP for: its tensors (or the pieces of assembled ones) by checkpoint name."""

    def __init__(self, module: nn.Module, source: WeightsSource, weights: WeightMap) -> None:
        self.state = module.state_dict()
        # A fused projection's strided shard is read replicated over tp, then put back (`load_weights`).
        self.described = describable(self.state)
        self.request: dict[str, Any] = {}
        self.twice: list[tuple[torch.Tensor, str]] = []  # two live tensors from one entry: read once, copied
        for key, value in self.described.items():
            if key in weights.direct:
                name = source.dcp_prefix + weights.direct[key]
                if name in self.request:
                    self.twice.append((value, name))
                else:
                    self.request[name] = value
            for part in weights.parts.get(key, []):
                fragment = _fragment(value, part, source.entries[part.name])
                if fragment is not None:
                    self.request[source.dcp_prefix + part.name] = fragment


def _fragment(value: torch.Tensor, part: Part, shape: tuple[int, ...]) -> BoxFragment | None:
    """The piece of ``value`` (this rank's shard of a model tensor) that ``part`` fills, as a view, or None."""
    local, offsets = (value.to_local(), local_box(value)) if isinstance(value, DTensor) else (value, (0,) * value.dim())
    starts = [max(o, p) for o, p in zip(offsets, part.offsets)]
    stops = [min(o + n, p + s) for o, n, p, s in zip(offsets, local.shape, part.offsets, part.sizes)]
    if any(start >= stop for start, stop in zip(starts, stops)):
        return None
    view = local
    for dim, (start, stop, offset) in enumerate(zip(starts, stops, offsets)):
        view = view.narrow(dim, start - offset, stop - start)
    source_offsets = [start - p for start, p in zip(starts, part.offsets)]
    if part.stack_dim is not None:
        view = view.squeeze(part.stack_dim)
        del source_offsets[part.stack_dim]
    return BoxFragment(shape, view, tuple(source_offsets))
