"""Context parallelism on an unchanged module: its batches split along the sequence, its attention made exact.

For one run, ``ContextParallel`` installs (every patch in the run's ``PatchLog``, undone at teardown):

- ``F.scaled_dot_product_attention`` -> ring or all-to-all attention over the cp group (``attention.py``) while a
  step's batch is split; other calls (prediction, a different length) go to torch's own;
- ``F.cross_entropy`` (``reduction="mean"``, class targets) -> the mean over the tokens of the whole sequence, not of
  this rank's shard: shards hold different numbers of ignored (padding) tokens;
- position ids that follow the global positions: an ``nn.Embedding`` called with ``arange(T_local) + c`` (learned
  positions: nanoGPT's ``wpe``, GPT-2, OPT) gets this rank's global positions ``+ c``, as do Hugging Face
  ``*RotaryEmbedding`` modules called with such ``position_ids``;
- a right-padding ``attention_mask`` in a dict batch made all ones (exact under causal attention when the padding's
  labels are -100, which is checked);
- Hugging Face causal LMs called with ``labels``: the labels are shifted on the whole sequence, then split
  (``shift_labels``), as ``accelerate``'s context parallelism does: shifting a shard would pair a chunk's last token
  with the first token of another chunk.

The step's returned loss keeps this rank's gradient but takes the value averaged over the cp group, so every rank
logs the loss of the whole sequence. Gradients average over ``dp x cp`` (the data-parallel wrap's mesh).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_mgpu._compat.attention import attn_implementation
from lightning_mgpu.layout import CP_AXIS
from lightning_mgpu.parallel.context.attention import alltoall_attention, block_attention, ring_attention
from lightning_mgpu.parallel.context.order import local_positions, shard_sequence
from lightning_mgpu.patches import PatchLog

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mgpu.options import ParallelOptions

_SPLIT_STEPS = ("training_step", "validation_step", "test_step")
# Buffers of rotary tables that a model slices by the (local) sequence length itself: they cannot follow the
# global positions (litgpt's `cos`/`sin`, torchtitan's `freqs_cis`).
_ROPE_TABLES = ("cos", "sin", "freqs_cis", "rope_cache", "freqs")


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Two equal chunks per context-parallel rank (the planner checks a model's sequence length with it)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context_parallel_size={cp} splits each sequence into {2 * cp} equal chunks (two per rank, balancing"
            f" the causal mask's work), but the batch's sequences have {seq_len} tokens. Pad or cut them to a"
            f" multiple of {2 * cp}, or choose a context_parallel_size whose double divides {seq_len}."
        )


def apply(module: nn.Module, mesh: DeviceMesh, options: ParallelOptions, patches: PatchLog) -> ContextParallel:
    """Context parallelism for ``module`` over ``mesh["cp"]``, attention by ``options.context_parallel_mode``: the
    run's batch splitting and the patches that make attention, losses and positions exact (into ``patches``)."""
    return ContextParallel(module, mesh[CP_AXIS].get_group(), options.context_parallel_mode, patches)


class ContextParallel:
    """The patches and per-step state of context parallelism over ``group`` (see the module docstring)."""

    def __init__(self, module: nn.Module, group: ProcessGroup, mode: str, patches: PatchLog) -> None:
        check_module(module)
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mode = mode
        self.attention_calls = 0
        self._active = False
        self._local_len = 0
        self._batch_size = 0
        self._positions: Tensor | None = None
        self._globals: dict[int, Tensor] = {}  # id(shard) -> the whole tensor it was cut from, for this step
        self._windows = _sliding_windows(module)
        self._sdpa = F.scaled_dot_product_attention
        self._cross_entropy = F.cross_entropy
        self.patch_functions(patches)
        # Prepended: the positions are made global before tensor parallelism's input hooks wrap them as DTensors.
        for submodule in module.modules():
            if isinstance(submodule, nn.Embedding):
                hook = submodule.register_forward_pre_hook(self._global_embedding_positions, prepend=True)
                patches.hook(hook)
            elif type(submodule).__name__.endswith("RotaryEmbedding"):
                rotary = self._global_rotary_positions
                hook = submodule.register_forward_pre_hook(rotary, with_kwargs=True, prepend=True)
                patches.hook(hook)
            if callable(getattr(submodule, "loss_function", None)) and "labels" in _parameters(submodule):
                patches.hook(submodule.register_forward_pre_hook(self._shifted_labels, with_kwargs=True))

    def patch_functions(self, patches: PatchLog) -> None:
        """torch's attention and cross-entropy routed through this run (undone when the run ends)."""
        patches.set_process_wide(F, "scaled_dot_product_attention", self._attention)
        patches.set_process_wide(F, "cross_entropy", self._token_mean_cross_entropy)

    # ------------------------------------------------------------------------------------------------- the step
    def split(self, method_name: str, args: tuple) -> tuple:
        """The step's batch (its first argument) with every ``(B, T, ...)`` tensor cut to this rank's tokens."""
        self._active = method_name in _SPLIT_STEPS and bool(args)
        self._globals.clear()
        if not self._active:
            return args
        batch = args[0]
        seq_len = _sequence_length(batch)
        check_sequence_length(seq_len, self.cp)
        for config, window in self._windows:
            if seq_len > window:
                raise NotImplementedError(
                    f"context_parallel_size={self.cp}: {config} attends through a sliding window of {window} tokens,"
                    f" shorter than the batch's {seq_len}; each rank's shard would build its window on local"
                    f" positions. Sequences up to {window} tokens are split exactly (the window covers them), or use"
                    " context_parallel_size=1 for longer ones."
                )
        self._local_len = seq_len // self.cp
        self._positions = None
        batch_size = self._batch_size = _batch_size(batch)
        batch = _causal_in_place_of_right_padding(batch, batch_size, seq_len, self.cp)

        def cut(tensor: Tensor) -> Tensor:
            if tensor.ndim < 2 or tensor.shape[0] != batch_size or tensor.shape[1] != seq_len:
                return tensor
            shard = shard_sequence(tensor, 1, self.cp, self.rank)
            self._globals[id(shard)] = tensor
            return shard

        return (apply_to_collection(batch, Tensor, cut), *args[1:])

    def finish(self, method_name: str, output: object) -> Any:
        """After the step's forward: refuse a model whose attention this never saw, and give the loss the value of
        the whole sequence (each rank keeps its own gradient)."""
        if not self._active:
            return output
        if method_name == "training_step" and self.attention_calls == 0:
            raise NotImplementedError(
                f"context_parallel_size={self.cp}: the model's forward called no"
                " `torch.nn.functional.scaled_dot_product_attention`, the only attention this version splits"
                " exactly over the sequence. Attention written by hand (softmax(q @ k^T)) or FlexAttention with a"
                " block mask would attend within this rank's shard only. Use SDPA (Hugging Face:"
                " attn_implementation='sdpa', the default), or context_parallel_size=1."
            )
        if isinstance(output, Tensor) and output.ndim == 0:
            return self._averaged(output)
        if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
            return {**output, "loss": self._averaged(output["loss"])}
        return output

    def _averaged(self, loss: Tensor) -> Tensor:
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=self.group)
        return loss + (mean / self.cp - loss.detach())

    def _local_positions(self, device: torch.device) -> Tensor:
        if self._positions is None or self._positions.device != device:
            self._positions = local_positions(self._local_len * self.cp, self.cp, self.rank, device)
        return self._positions

    # ------------------------------------------------------------------------------------------------ patches
    def _attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if not self._active or query.ndim != 4 or query.shape[2] != self._local_len or key.shape[2] != self._local_len:
            return self._sdpa(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )  # fmt: skip
        if attn_mask is not None:
            raise NotImplementedError(
                f"context_parallel_size={self.cp}: scaled_dot_product_attention got an explicit attn_mask"
                f" {tuple(attn_mask.shape)} (a sliding-window, document or other custom mask, built on this rank's"
                " shard), which cannot be split exactly. Causal masks (`is_causal`) and right padding (a batch's"
                " `attention_mask` with the padding's `labels` at -100) are split exactly; sliding-window models"
                " (Mistral, Gemma 2-3, ...) need context_parallel_size=1."
            )
        if dropout_p > 0:
            raise NotImplementedError(
                f"context_parallel_size={self.cp}: attention dropout ({dropout_p}) is not split over the sequence."
                " Set the model's attention dropout to 0, or use context_parallel_size=1."
            )
        if isinstance(query, DTensor):  # heads sharded over tensor parallelism: attention runs on the local heads
            if any(p.is_shard(2) or p.is_shard(-2) for p in query.placements):
                raise NotImplementedError(
                    f"context_parallel_size={self.cp}: the attention's queries are split along the sequence by"
                    f" tensor parallelism ({query.placements}); context parallelism splits it already."
                )
            q, k, v = (t.to_local() if isinstance(t, DTensor) else t for t in (query, key, value))
            out = self._split_attention(q, k, v, is_causal, scale)
            return DTensor.from_local(out, query.device_mesh, query.placements)
        return self._split_attention(query, key, value, is_causal, scale)

    def _split_attention(
        self, query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: float | None
    ) -> Tensor:
        self.attention_calls += 1
        if self.mode == "alltoall":
            if query.shape[1] % self.cp:
                raise ValueError(
                    f"context_parallel_mode='alltoall' scatters the attention heads over the {self.cp} cp ranks,"
                    f" but this attention has {query.shape[1]} heads per rank (after tensor parallelism). Use"
                    " context_parallel_mode='ring' (any head count), or a context_parallel_size dividing"
                    f" {query.shape[1]}."
                )
            return alltoall_attention(query, key, value, is_causal, scale, self.group, block_attention)
        return ring_attention(query, key, value, is_causal, scale, self.group)

    def _token_mean_cross_entropy(self, input: Tensor, target: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        options = inspect.signature(self._cross_entropy).bind(input, target, *args, **kwargs).arguments
        plain = options.get("reduction", "mean") == "mean" and options.get("weight") is None
        plain = plain and options.get("size_average") is None and options.get("reduce") is None
        if not self._active or not plain or target.is_floating_point():
            return self._cross_entropy(input, target, *args, **kwargs)
        if self._local_len > 1 and target.numel() == self._batch_size:
            raise NotImplementedError(
                f"context_parallel_size={self.cp} splits each sequence over {self.cp} ranks, but this loss has one"
                f" target per sequence (shape {list(target.shape)}): a head that pools a position (BERT's [CLS]"
                " pooler, a last-token classifier) would see only this rank's part of the sequence. Context"
                " parallelism serves token-level losses (language modelling); use context_parallel_size=1 here."
            )
        options["reduction"] = "sum"
        total = self._cross_entropy(**options)
        counts = torch.stack([(target != options.get("ignore_index", -100)).sum().to(total.dtype), total.detach()])
        dist.all_reduce(counts, group=self.group)
        tokens, whole = counts[0], counts[1]
        local = total * self.cp / tokens  # averaged over the cp ranks' gradients: the whole sequence's mean
        return local + (whole / tokens - local.detach())

    def _global_embedding_positions(self, module: nn.Module, args: tuple) -> tuple | None:
        if not self._active or not args or id(args[0]) in self._globals:
            return None  # a token embedding gets the batch's own (already split) ids
        positions = self._as_global(args[0])
        return None if positions is None else (positions, *args[1:])

    def _global_rotary_positions(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if not self._active:
            return None
        if "position_ids" in kwargs:
            positions = self._as_global(kwargs["position_ids"])
            return None if positions is None else (args, {**kwargs, "position_ids": positions})
        if len(args) >= 2:
            positions = self._as_global(args[1])
            return None if positions is None else ((args[0], positions, *args[2:]), kwargs)
        return None

    def _as_global(self, ids: Any) -> Tensor | None:
        """``arange(T_local) + c`` (any leading shape) -> this rank's global positions ``+ c``; else None."""
        if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.ndim == 0 or ids.shape[-1] != self._local_len:
            return None
        rows = ids.reshape(-1, self._local_len)
        local = torch.arange(self._local_len, device=ids.device)
        offsets = rows[:, :1]
        if not torch.equal(rows - offsets, local.expand_as(rows)):
            return None
        return (self._local_positions(ids.device) + offsets).reshape(ids.shape).to(ids.dtype)

    def _shifted_labels(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        labels = kwargs.get("labels")
        if not self._active or labels is None or "shift_labels" in kwargs:
            return None
        whole = self._globals.get(id(labels))
        if whole is None:
            raise NotImplementedError(
                f"context_parallel_size={self.cp}: {type(module).__name__} got `labels` that are not a tensor of the"
                " batch itself (computed inside the step): the model shifts them by one token, which needs the"
                " whole sequence. Pass the batch's labels tensor unchanged, or compute the loss from `.logits`."
            )
        shifted = F.pad(whole[:, 1:], (0, 1), value=-100)
        return args, {**kwargs, "shift_labels": shard_sequence(shifted, 1, self.cp, self.rank)}


def check_module(module: nn.Module) -> None:
    """Before training: attention other than SDPA (Hugging Face's ``attn_implementation``), and rotary tables the
    model slices by the local length itself, which cannot follow global positions."""
    for name, config in _hf_configs(module):
        implementation = attn_implementation(config)
        if implementation not in (None, "sdpa"):
            raise NotImplementedError(
                f"Context parallelism splits `torch.nn.functional.scaled_dot_product_attention` exactly, but"
                f" {type(config).__name__} of `{name or 'the module'}` uses attn_implementation="
                f"{implementation!r}, which would attend within each rank's shard only. Build the model with"
                " attn_implementation='sdpa' (the default where the model supports it), or use"
                " context_parallel_size=1."
            )
    for name, submodule in module.named_modules():
        if type(submodule).__name__.endswith("RotaryEmbedding"):
            continue
        for buffer_name, _ in submodule.named_buffers(recurse=False):
            if buffer_name in _ROPE_TABLES:
                where = f"{name}.{buffer_name}" if name else buffer_name
                raise NotImplementedError(
                    f"Context parallelism cannot follow the global positions of {type(submodule).__name__}'s rotary"
                    f" table `{where}`: the model slices it by the sequence length it sees, which is this rank's"
                    " shard. Models that take positions as `position_ids` (Hugging Face) or learned position"
                    " embeddings (nanoGPT, GPT-2) are supported; use context_parallel_size=1 for this one."
                )


def _causal_in_place_of_right_padding(batch: object, batch_size: int, seq_len: int, cp: int) -> Any:
    """A batch's right-padding ``attention_mask`` (Hugging Face's dict batches) made all ones.

    Under a causal mask, the tokens before the padding never see it: their outputs are the same with or without
    the padding mask. Only the padding's own outputs differ, and they are not trained when their ``labels`` are the
    ignore index (-100), which is required. Without the mask, the model's attention is plain causal SDPA, which is
    split exactly; a mask built from the padding on one shard could not be."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("attention_mask"), Tensor):
        return batch
    mask = batch["attention_mask"]
    if mask.shape != (batch_size, seq_len):
        return batch
    kept = mask.bool()
    if bool((kept[:, 1:] & ~kept[:, :-1]).any()):
        raise NotImplementedError(
            f"context_parallel_size={cp}: the batch's `attention_mask` has padding before tokens (left padding, or"
            " packed documents), which cannot be split over the sequence exactly. Pad on the right (a tokenizer's"
            " padding_side='right'), or use context_parallel_size=1."
        )
    labels = batch.get("labels")
    if not kept.all() and (
        not isinstance(labels, Tensor) or labels.shape != mask.shape or bool((labels[~kept] != -100).any())
    ):
        raise NotImplementedError(
            f"context_parallel_size={cp}: the batch's `attention_mask` pads on the right, which is split exactly"
            " when the padding is not trained: give the batch `labels` with the ignore index (-100) wherever"
            " `attention_mask` is 0 (Hugging Face's DataCollatorForLanguageModeling and DataCollatorWithPadding"
            " with label padding do), or use context_parallel_size=1."
        )
    return {**batch, "attention_mask": torch.ones_like(mask)}


def _hf_configs(module: nn.Module) -> list[tuple[str, Any]]:
    """Every Hugging Face ``PretrainedConfig`` held by a submodule (``model.config``), once each."""
    found: dict[int, tuple[str, Any]] = {}
    for name, submodule in module.named_modules():
        config = getattr(submodule, "config", None)
        if callable(getattr(config, "to_diff_dict", None)) and id(config) not in found:  # a PretrainedConfig
            found[id(config)] = (name, config)
    return list(found.values())


def _sliding_windows(module: nn.Module) -> list[tuple[str, int]]:
    """Sliding-window attention a Hugging Face config turns on (Mistral, Gemma 2-3, Qwen 2 with
    ``use_sliding_window``): ``(config class, window)``."""
    windows = []
    for _, config in _hf_configs(module):
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
            continue
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None or "sliding_attention" in layer_types:
            windows.append((type(config).__name__, window))
    return windows


def _parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _sequence_length(batch: object) -> int:
    """The batch's sequence length: dim 1 of its first integer tensor of two or more dims (the token ids)."""
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(t) if t.ndim >= 2 and not t.is_floating_point() else None)
    if not found:
        raise ValueError(
            "Context parallelism splits token sequences, but the batch holds no integer tensor of shape"
            " (batch, sequence, ...). Batches of token ids (input_ids, labels) are supported."
        )
    return found[0].shape[1]


def _batch_size(batch: object) -> int:
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(t) if t.ndim >= 2 and not t.is_floating_point() else None)
    return found[0].shape[0]
