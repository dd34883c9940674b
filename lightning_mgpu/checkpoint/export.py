"""The trained model written as a Hugging Face checkpoint by every rank at once, never gathered on one.

Each rank writes the slices it holds (DCP's ``HuggingFaceStorageWriter``, replicated slices once), then the ranks
share out the final files: each assembles some of ``model-0000k-of-0000N.safetensors`` from the slices, one tensor
at a time (torch's ``consolidate_safetensors_files_on_every_rank``, which also writes
``model.safetensors.index.json``). Names are the module's own with the Hugging Face model's prefix removed (and a
wrapper's attribute: a LoRA layer's ``base_layer``), and the model's ``config.json`` goes beside them, so
``from_pretrained(path)`` loads the result; LoRA adapters are saved beside the weights under their own names.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from lightning_mgpu.checkpoint.pretrained import unwrapped
from lightning_mgpu.checkpoint.states import describable

DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's max_shard_size default ("5GB")
_SLICES = "slices"  # the ranks' pieces, removed once the files are assembled


def hf_model_prefix(module: nn.Module) -> tuple[str, Any | None]:
    """The outermost Hugging Face ``PreTrainedModel`` in ``module``: its state-dict prefix and itself (``""`` and
    ``None`` when there is none or several)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return "", None
    found = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, PreTrainedModel)]
    outermost = [(n, s) for n, s in found if not any(n != m and n.startswith(m + ".") for m, _ in found)]
    if len(outermost) != 1:
        return "", None
    name, model = outermost[0]
    return (f"{name}." if name else ""), model


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_bytes(size: int | str) -> int:
    """``max_shard_size`` as bytes: an integer, or Hugging Face's notation (``"500MB"``, ``"5GB"``, ``"2GiB"``)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip().upper().replace(" ", "")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), None)
    try:
        number = float(text[: -len(unit)] if unit else text)
    except ValueError:
        number = -1.0
    if number <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or e.g. '5GB', got {size!r}.")
    return int(number * _UNITS[unit or "B"])


def shard_plan(sizes: dict[str, int], max_bytes: int) -> dict[str, int]:
    """File index (1, 2, ...) of each name, in name order, each file holding at most ``max_bytes`` (or one tensor)."""
    plan: dict[str, int] = {}
    index, used = 1, 0
    for name in sorted(sizes):
        if used and used + sizes[name] > max_bytes:
            index, used = index + 1, 0
        plan[name] = index
        used += sizes[name]
    return plan


@torch.no_grad()
def save_hf_checkpoint(module: nn.Module, path: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``module``'s weights (parallelized or not) under ``path`` as Hugging Face safetensors shards with their
    index and, for a Hugging Face model, its ``config.json``. Collective over every rank."""
    path = Path(path)
    prefix, hf_model = hf_model_prefix(module)
    state = describable(_without_tied_copies(module))
    # A wrapper's weights under the wrapped module's names (a LoRA layer's base weight as the projection's).
    state = {unwrapped(key[len(prefix) :]): value for key, value in state.items() if key.startswith(prefix)}
    sizes = {key: value.numel() * value.element_size() for key, value in state.items()}
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:  # a pipeline stage holds its own entries: the file plan covers everyone's
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, sizes)
        sizes = {key: size for part in every for key, size in part.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    slices = path / _SLICES
    if not distributed or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        if slices.exists():
            shutil.rmtree(slices)
    if distributed:
        dist.barrier()
    writer = HuggingFaceStorageWriter(str(slices), fqn_to_index_mapping=plan, save_distributed=True)
    dcp.save(state, storage_writer=writer)
    from lightning_mgpu._compat.dcp import consolidate_safetensors_on_every_rank

    consolidate_safetensors_on_every_rank(slices, path, plan)
    if not distributed or dist.get_rank() == 0:
        shutil.rmtree(slices, ignore_errors=True)
        if hf_model is not None:
            hf_model.config.save_pretrained(path)
            generation = getattr(hf_model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(path)
    if distributed:
        dist.barrier()
    return path


def _without_tied_copies(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with a tied parameter under its first name only (Hugging Face saves it once)."""
    state = module.state_dict(keep_vars=True)
    seen: set[int] = set()
    kept = {}
    for key, value in state.items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        kept[key] = value.detach()
    return kept
