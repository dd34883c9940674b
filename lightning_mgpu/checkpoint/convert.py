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
from lightning_mgpu.checkpoint import states
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
    full = {k: v for k, v in meta.items() if not weights_only or k in _WEIGHTS_ONLY_KEYS}
    full[MODEL_KEY] = shards.get(MODEL_KEY, {})
    # Model states a checkpoint hook moved (EMAWeightAveraging's `current_model_state`) stay where it put them.
    full.update({k: v for k, v in shards.items() if k not in (MODEL_KEY, OPTIMIZER_KEY) and not weights_only})
    info = dict(meta.get(INFO_KEY, {}))
    info["format"] = "full"
    if weights_only:
        info = {k: v for k, v in info.items() if k in ("format_version", "format", "hf_models")}
    full[INFO_KEY] = info
    if not weights_only and OPTIMIZER_KEY in shards:
        groups = info.get("optimizer_param_groups")
        if groups is None:
            raise CheckpointError(f"{path}/{fmt.METADATA_FILE} does not name the optimizers' parameters.")
        full[OPTIMIZER_KEY] = [states.flat_to_native(flat, g) for flat, g in zip(shards[OPTIMIZER_KEY], groups)]
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


def save_safetensors(checkpoint: dict[str, Any], out: Path, prefix: str) -> list[str]:
    """Write the weights (``prefix`` stripped, e.g. to Hugging Face names); return the keys outside ``prefix``."""
    from safetensors.torch import save_file

    tensors, outside = {}, []
    for key, value in checkpoint[MODEL_KEY].items():
        if prefix and key.startswith(prefix):
            key = key[len(prefix) :]
        elif prefix:
            outside.append(key)
        tensors[key] = value.detach().contiguous()
    metadata = {"format": "pt"}
    hf = (checkpoint.get(INFO_KEY, {}).get("hf_models") or {}).get(prefix.rstrip("."))
    if hf:
        metadata["hf_class"] = hf["class"]
    save_file(tensors, str(out), metadata=metadata)
    return outside


def write_consolidated(
    path: Path,
    out: Path,
    out_format: str = "torch",
    weights_only: bool = False,
    prefix: str = "auto",
    load_weights_only: bool | None = None,
) -> str:
    """The ``lightning-mgpu consolidate`` command; returns a one-line summary."""
    checkpoint = consolidate(
        path, weights_only=weights_only or out_format == "safetensors", load_weights_only=load_weights_only
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = fmt.partial_path(out)
    fmt.remove(partial)
    note = ""
    if out_format == "safetensors":
        resolved = hf_prefix(checkpoint, prefix)
        outside = save_safetensors(checkpoint, partial, resolved)
        note = f", prefix {resolved!r} stripped" if resolved else ""
        if outside:
            note += f" ({len(outside)} keys outside it kept as they are: {', '.join(outside[:4])}...)"
        hf = (checkpoint.get(INFO_KEY, {}).get("hf_models") or {}).get(resolved.rstrip("."))
        if hf:
            config = out.with_name("config.json")
            if not config.exists():
                config.write_text(json.dumps(json.loads(hf["config"]), indent=2))
                note += f"; wrote {config.name} for {hf['class']}.from_pretrained"
    elif out_format == "torch":
        fmt.write_file(checkpoint, partial)
    else:
        raise ValueError(f"--format must be 'torch' or 'safetensors', got {out_format!r}.")
    fmt.publish(partial, out)
    return f"wrote {out} ({len(checkpoint[MODEL_KEY])} tensors{note})"


# ------------------------------------------------------------------------------------------------------- inspect
def _describe_layout(record: Any) -> str:
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
