"""torch.distributed.checkpoint internals (checked on torch 2.13.0).

- ``parameter_fqns``: ``state_dict._get_fqns``, the names a parameter has in a state dict once wrapper prefixes
  (activation checkpointing, ``torch.compile``) are removed. The public ``get_model_state_dict`` applies it, but
  does not say which parameter each name belongs to, which optimizer-state conversion needs.
- ``load_without_process_group``: ``state_dict_loader._load_state_dict(no_dist=True)`` with
  ``default_planner._EmptyStateDictLoadPlanner``: read a DCP directory into an empty dict in one process. The public
  ``format_utils.dcp_to_torch_save`` does exactly this but only writes the result to a file.
- ``consolidate_safetensors_on_every_rank``:
  ``_consolidate_hf_safetensors.consolidate_safetensors_files_on_every_rank``, the ranks assembling the files of a
  Hugging Face checkpoint from the slices ``HuggingFaceStorageWriter`` wrote with ``save_distributed=True``. The
  writer's own ``enable_consolidation`` does it on one rank only.
- ``flatten_state_dict``: ``_nested_dict.flatten_state_dict``, DCP's own flattening of nested state dicts into its
  dotted keys (also re-exported by ``format_utils``, not in its ``__all__``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from lightning_mgpu._compat import internal

flatten_state_dict = internal("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")


def parameter_fqns(model: nn.Module, name: str) -> set[str]:
    """The state-dict names of the parameter ``model.named_parameters()`` calls ``name``."""
    return set(internal("torch.distributed.checkpoint.state_dict", "_get_fqns")(model, name))


def load_without_process_group(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Every (or the listed top-level) entry of the DCP directory ``path`` as full tensors, in this process."""
    from torch.distributed.checkpoint import FileSystemReader

    load = internal("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict")
    planner = internal("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner")
    state: dict[str, Any] = {}
    load(state, storage_reader=FileSystemReader(path), planner=planner(keys=keys), no_dist=True)
    return state


def consolidate_safetensors_on_every_rank(slices: Path, out: Path, fqn_to_index: dict[str, int]) -> None:
    """Assemble ``out``'s safetensors files (and their index) from the slices in ``slices``, the files shared out
    over the ranks. Collective."""
    consolidate = internal(
        "torch.distributed.checkpoint._consolidate_hf_safetensors", "consolidate_safetensors_files_on_every_rank"
    )
    consolidate(str(slices), str(out), fqn_to_index)
