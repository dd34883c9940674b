"""Checkpoints keyed by the plain module's FQNs: saved under any layout, loaded under any other.

- ``format``: the on-disk formats (sharded DCP directory, full file), atomic publishing, completeness checks,
  checksums (a directory's ``manifest.json``, a full file's zip CRCs).
- ``states``: model/optimizer/RNG states of the live objects, conversions between optimizer formats.
- ``checkpointer``: ``Checkpointer``, what ``HybridStrategy``'s checkpoint hooks call (sync/async, sharded/full).
- ``resume``: continuing the training data where a checkpoint stopped (mid-epoch, or after ``fit`` returned).
- ``pretrained``: pretrained weights (Hugging Face, torch, ours) read into a parallelized model, slices per rank.
- ``export``: the model written as a Hugging Face checkpoint by every rank.
- ``convert``: consolidation to one file (torch or safetensors) and ``inspect``, without a process group.
"""

from lightning_mgpu.checkpoint.checkpointer import Checkpointer
from lightning_mgpu.checkpoint.convert import consolidate, describe, write_consolidated
from lightning_mgpu.checkpoint.export import save_hf_checkpoint
from lightning_mgpu.checkpoint.format import METADATA_FILE, CheckpointError, is_sharded_checkpoint
from lightning_mgpu.checkpoint.states import full_model_state_dict

__all__ = [
    "METADATA_FILE",
    "CheckpointError",
    "Checkpointer",
    "consolidate",
    "describe",
    "full_model_state_dict",
    "is_sharded_checkpoint",
    "save_hf_checkpoint",
    "write_consolidated",
]
