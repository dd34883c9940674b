"""Consolidate a sharded checkpoint into one file, and describe a checkpoint; in one process, no process group."""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_mgpu._compat.dcp import load_without_process_group
from lightning_mgpu.checkpoint import format as fmt
from lightning_mgpu.checkpoint import states, stream
from lightning_mgpu.checkpoint.format import INFO_KEY, LAYOUT_KEY, MODEL_KEY, OPTIMIZER_KEY, CheckpointError

# What a weights-only file keeps besides `state_dict`: enough for `LightningModule.load_from_checkpoint`.
_WEIGHTS_ONLY_KEYS = (
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "hyper_parameters",
    "hparams_name",
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
    LAYOUT_KEY,
)


def _read_shards(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Every (or the listed top-level) entry of a DCP directory as full tensors, in this process only."""
    return load_without_process_group(path, keys)


def consolidate_directory(path: Path, meta: dict[str, Any], weights_only: bool = False) -> dict[str, Any]:
    """The single-file (``"full"``) checkpoint equivalent to the sharded directory ``path`` with ``meta``."""
    shards = _read_shards(path, keys={MODEL_KEY} if weights_only else None)
    flat = {f"{MODEL_KEY}.{k}": v for k, v in shards.get(MODEL_KEY, {}).items()}
    for i, optimizer in enumerate(shards.get(OPTIMIZER_KEY, [])):
        flat.update({f"{OPTIMIZER_KEY}.{i}.{k}": v for k, v in optimizer.items()})
    for top, entries in shards.items():
        if top not in (MODEL_KEY, OPTIMIZER_KEY) and isinstance(entries, dict):
            flat.update({f"{top}.{k}": v for k, v in entries.items()})
    return consolidate_directory_from(flat, meta, weights_only, path)


def consolidate_directory_from(
    flat: dict[str, object], meta: dict[str, Any], weights_only: bool, path: Path
) -> dict[str, Any]:
    """The full checkpoint from a sharded directory's entries by their DCP keys (``state_dict.<fqn>``,
    ``optimizer_states.<i>.<flat key>``; values or placeholders) and its ``meta``."""
    full = {k: v for k, v in meta.items() if not weights_only or k in _WEIGHTS_ONLY_KEYS}
    model_prefix = f"{MODEL_KEY}."
    full[MODEL_KEY] = {k[len(model_prefix) :]: v for k, v in flat.items() if k.startswith(model_prefix)}
    if not weights_only:  # model states a checkpoint hook moved (EMAWeightAveraging's `current_model_state`) stay
        for key, value in flat.items():
            top, _, rest = key.partition(".")
            if top not in (MODEL_KEY, OPTIMIZER_KEY) and rest:
                full.setdefault(top, {})[rest] = value
    info = dict(meta.get(INFO_KEY, {}))
    info["format"] = "full"
    if weights_only:
        info = {k: v for k, v in info.items() if k in ("format_version", "format", "hf_models")}
    full[INFO_KEY] = info
    optimizers: dict[int, dict[str, object]] = {}
    for key, value in flat.items():
        if key.startswith(OPTIMIZER_KEY + "."):
            index, rest = key[len(OPTIMIZER_KEY) + 1 :].split(".", 1)
            optimizers.setdefault(int(index), {})[rest] = value
    if not weights_only and optimizers:
        groups = info.get("optimizer_param_groups")
        if groups is None:
            raise CheckpointError(f"{path}/{fmt.METADATA_FILE} does not name the optimizers' parameters.")
        ordered = [optimizers.get(i, {}) for i in range(len(groups))]
        full[OPTIMIZER_KEY] = [states.flat_to_native(flat_i, g) for flat_i, g in zip(ordered, groups)]
    return full


def consolidate(path: Path, weights_only: bool = False, load_weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded directory (or a full file) as one Lightning checkpoint dict with plain ``state_dict`` keys."""
    fmt.check_exists(path)
    fmt.check_intact(path)
    if not path.is_dir():
        full = fmt.load_file(path, load_weights_only)
        if weights_only:
            full = {k: v for k, v in full.items() if k in _WEIGHTS_ONLY_KEYS or k in (MODEL_KEY, INFO_KEY)}
        return full
    fmt.check_sharded(path)
    return consolidate_directory(path, fmt.load_file(path / fmt.METADATA_FILE, load_weights_only), weights_only)


def hf_prefix(checkpoint: dict[str, Any], requested: str = "auto") -> str:
    """The key prefix of the Hugging Face model inside the LightningModule ("" for none)."""
    if requested != "auto":
        return "" if requested in ("", "none") else requested.rstrip(".") + "."
    recorded = checkpoint.get(INFO_KEY, {}).get("hf_models") or {}
    if len(recorded) == 1:
        return next(iter(recorded)) + "."
    keys = list(checkpoint[MODEL_KEY])
    if keys and all(k.startswith("model.") for k in keys):
        return "model."
    return ""


def write_consolidated(
    path: Path,
    out: Path,
    out_format: str = "torch",
    weights_only: bool = False,
    prefix: str = "auto",
    load_weights_only: bool | None = None,
) -> str:
    """The ``lightning-mgpu consolidate`` command, tensor by tensor (``stream.py``: the process holds the largest
    tensor, not the model); returns a one-line summary."""
    if out_format not in ("torch", "safetensors"):
        raise ValueError(f"--format must be 'torch' or 'safetensors', got {out_format!r}.")
    skeleton, fill = _streamable(path, weights_only or out_format == "safetensors", load_weights_only)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = fmt.partial_path(out)
    fmt.remove(partial)
    note = ""
    if out_format == "safetensors":
        resolved = hf_prefix(skeleton, prefix)
        named, outside = {}, []
        for key, leaf in skeleton[MODEL_KEY].items():
            if resolved and not key.startswith(resolved):
                outside.append(key)
            named[key[len(resolved) :] if resolved and key.startswith(resolved) else key] = leaf
        hf = (skeleton.get(INFO_KEY, {}).get("hf_models") or {}).get(resolved.rstrip("."))
        metadata = {"format": "pt", **({"hf_class": hf["class"]} if hf else {})}
        stream.write_safetensors(partial, named, fill, metadata)
        note = f", prefix {resolved!r} stripped" if resolved else ""
        if outside:
            note += f" ({len(outside)} keys outside it kept as they are: {', '.join(outside[:4])}...)"
        if hf:
            config = out.with_name("config.json")
            if not config.exists():
                config.write_text(json.dumps(json.loads(hf["config"]), indent=2))
                note += f"; wrote {config.name} for {hf['class']}.from_pretrained"
    else:
        stream.write_torch(partial, skeleton, fill)
    fmt.publish(partial, out)
    return f"wrote {out} ({len(skeleton[MODEL_KEY])} tensors{note})"


def _streamable(path: Path, weights_only: bool, load_weights_only: bool | None) -> tuple[dict[str, Any], stream.Fill]:
    """The checkpoint at ``path`` as ``consolidate`` would return it, its tensors ``stream.Leaf`` placeholders, and
    the function reading one leaf's tensor whole."""
    fmt.check_exists(path)
    fmt.check_intact(path)
    if not path.is_dir():
        loaded = consolidate(path, weights_only, load_weights_only)  # memory-mapped: pages are read as written
        table: dict[str, torch.Tensor] = {}
        skeleton = _as_leaves(loaded, "", table)
        return skeleton, lambda leaf: table[leaf.key]
    fmt.check_sharded(path)
    return _directory_leaves(path, fmt.load_file(path / fmt.METADATA_FILE, load_weights_only), weights_only)


def write_full_file(directory: Path, meta: dict[str, Any], out: Path) -> None:
    """The single-file checkpoint of the sharded ``directory`` (shards written, ``meta`` in hand), written tensor by
    tensor: what a save in the ``"full"`` format publishes once every rank wrote its shards."""
    skeleton, fill = _directory_leaves(directory, meta, weights_only=False)
    stream.write_torch(out, skeleton, fill)
    fmt.fsync(out)


def _directory_leaves(path: Path, meta: dict[str, Any], weights_only: bool) -> tuple[dict[str, Any], stream.Fill]:
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    wanted = [k for k in metadata if not weights_only or k.startswith(MODEL_KEY + ".")]
    tensors = {k: md for k in wanted if isinstance(md := metadata[k], TensorStorageMetadata)}
    small = _read_entries(path, [k for k in wanted if k not in tensors])  # hyperparameters: a few bytes each
    flat: dict[str, object] = {**small}
    for key, md in tensors.items():
        flat[key] = stream.Leaf(key, tuple(md.size), md.properties.dtype)
    skeleton = consolidate_directory_from(flat, meta, weights_only, path)
    return skeleton, lambda leaf: _read_tensor(path, leaf)


def _as_leaves(value: object, path: str, table: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        table[path] = value
        return stream.Leaf(path, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _as_leaves(v, f"{path}/{k}", table) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_leaves(v, f"{path}/{i}", table) for i, v in enumerate(value))
    return value


def _read_entries(path: Path, keys: list[str]) -> dict[str, object]:
    if not keys:
        return {}
    import torch.distributed.checkpoint as dcp

    state: dict[str, object] = dict.fromkeys(keys)
    dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    return state


def _read_tensor(path: Path, leaf: stream.Leaf) -> torch.Tensor:
    """One tensor of a DCP directory, whole, reassembled from the shards that hold it."""
    import torch.distributed.checkpoint as dcp

    state = {leaf.key: torch.empty(leaf.shape, dtype=leaf.dtype)}
    dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    return state[leaf.key]


# ------------------------------------------------------------------------------------------------------- inspect
def _describe_layout(record: object) -> str:
    """A saved layout record (``checkpointer.layout_record``) as ``ParallelLayout.describe`` says it."""
    from lightning_mgpu.layout import ParallelLayout

    if not isinstance(record, dict):
        return str(record)
    # Sizes a checkpoint of an older version does not record (context_parallel_size) have their default.
    fields = {field.name: record[field.name] for field in dataclasses.fields(ParallelLayout) if field.name in record}
    return ParallelLayout(**fields).describe()


def describe(path: Path, show_optimizer: bool = False, load_weights_only: bool | None = None) -> str:
    """What ``lightning-mgpu inspect`` prints: format, layout, progress, and the tensors with their shapes."""
    meta = fmt.read_metadata(path, load_weights_only)
    info = meta.get(INFO_KEY, {})
    if path.is_dir():
        index = FileSystemReader(path).read_metadata().state_dict_metadata
        shapes = {
            k: (tuple(v.size), str(v.properties.dtype).replace("torch.", ""))
            for k, v in index.items()
            if isinstance(v, TensorStorageMetadata)
        }
        files = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")
        kind = f"sharded (DCP directory, {len(files)} shard files)"
        manifest = (path / fmt.MANIFEST_FILE).is_file()
        verified = "every file verified (CRC-32)" if manifest else "none (saved by an earlier version)"
    else:
        shapes = {
            f"{MODEL_KEY}.{k}": (tuple(v.shape), str(v.dtype).replace("torch.", ""))
            for k, v in meta.get(MODEL_KEY, {}).items()
            if isinstance(v, torch.Tensor)
        }
        for i, optimizer in enumerate(meta.get(OPTIMIZER_KEY, [])):
            for pid, state in optimizer.get("state", {}).items():
                for name, v in state.items():
                    if isinstance(v, torch.Tensor):
                        key = f"{OPTIMIZER_KEY}.{i}.state.{pid}.{name}"
                        shapes[key] = (tuple(v.shape), str(v.dtype).replace("torch.", ""))
        kind = "full (one file)" if info else "full (one file, plain Lightning)"
        verified = "every record verified (CRC-32)" if zipfile.is_zipfile(path) else "none (torch's legacy format)"
    layout = meta.get(LAYOUT_KEY)
    lines = [
        f"{path}: {kind}, format version {info.get('format_version', '-')}",
        f"layout: {_describe_layout(layout) if layout else 'unknown'}"
        + (f", {layout['world_size']} processes" if isinstance(layout, dict) else ""),
        f"progress: epoch {meta.get('epoch', '-')}, global step {meta.get('global_step', '-')}",
        f"checksums: {verified}",
    ]
    model = {k[len(MODEL_KEY) + 1 :]: v for k, v in shapes.items() if k.startswith(MODEL_KEY + ".")}
    numel = sum(int(torch.Size(s).numel()) for s, _ in model.values())
    optimizer = {k: v for k, v in shapes.items() if k.startswith(OPTIMIZER_KEY + ".")}
    lines.append(f"model: {len(model)} tensors, {numel:,} elements")
    width = max((len(k) for k in model), default=0)
    lines += [f"  {k:<{width}}  {list(s)}  {d}" for k, (s, d) in model.items()]
    if optimizer:
        hint = "" if show_optimizer else " (--optimizer lists them)"
        lines.append(f"optimizer states: {len(optimizer)} tensors{hint}")
        if show_optimizer:
            width = max(len(k) for k in optimizer)
            lines += [f"  {k:<{width}}  {list(s)}  {d}" for k, (s, d) in optimizer.items()]
    else:
        lines.append("optimizer states: none (weights only)")
    extras = [k for k in ("lr_schedulers", "callbacks", "loops") if meta.get(k)]
    if extras:
        lines.append(f"also: {', '.join(extras)}")
    if info.get("hf_models"):
        lines.append("Hugging Face models: " + ", ".join(f"{k} ({v['class']})" for k, v in info["hf_models"].items()))
    return "\n".join(lines)
