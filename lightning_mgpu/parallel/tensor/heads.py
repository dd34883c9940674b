"""Per-head values of attention modules that run on plain per-rank shards (Hugging Face models, see ``apply.py``).

A rank of a column-parallel attention holds its own heads: a contiguous block of query heads and of key/value heads,
as the column shards of ``q_proj``/``k_proj``/``v_proj`` give them. Two kinds of per-head values are not covered by
the projection styles of a plan:

- Bare parameters with one entry (or row) per head, held by the attention or by a helper module of it that the plan
  does not name (Doge's ``A`` per key/value head, NeoMME's exclusive-attention ``alpha`` per query head). Left
  replicated, a rank would apply every head's value to its own heads. They are sharded over their first dimension
  like the heads (``Shard(0)``), and their module's forward runs on the local shard (swapped in for the call, always
  swapped back): checkpoints and optimizers see the global parameter, and each rank's gradient of its entries is
  whole, since only its heads use them.
- A row-parallel projection whose output has one feature per head (Doge's ``dt_proj``, which Hugging Face's plan
  gives ``rowwise``): it reads every head's values, so it is row-parallel, but its output all-reduced whole would
  hand the rank every head's value for its own heads. It is reduce-scattered instead: the same sum, each rank keeping
  its own heads' part.
- Per-token inputs of the attention as wide as some of its heads (NeoMME's value embeddings, computed once per
  model, ``num_key_value_heads * head_dim`` wide, added to each layer's values): each rank takes its own heads' part
  (``Replicate`` -> ``Shard(-1)``, no communication; backward all-gathers the gradient, which is then whole on every
  rank, as the replicated module producing the input needs).

A module counts as an attention when it keeps a head size or head count (``head_dim``, ``num_heads``, ...); the head
counts are its own attributes or its configuration's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_mgpu._compat.tensors import restore_parameters, swap_parameters
from lightning_mgpu.parallel.blocks import is_projection
from lightning_mgpu.parallel.tensor.checks import _KEY_VALUE_HEADS, _QUERY_HEADS, _head_count

_ATTENTION_MARKS = ("head_dim", "head_size", *_QUERY_HEADS)


def head_counts(module: nn.Module) -> set[int]:
    """The query and key/value head counts of an attention module; empty for a module that is not one."""
    if not any(isinstance(getattr(module, name, None), int) for name in _ATTENTION_MARKS):
        return set()
    counts = {_head_count(module, _QUERY_HEADS), _head_count(module, _KEY_VALUE_HEADS)}
    return {count for count in counts if count}


def _region_of(name: str, regions: set[str]) -> str | None:
    return next((r for r in sorted(regions, key=len, reverse=True) if name.startswith(r + ".")), None)


def per_head_outputs(module: nn.Module, matched: dict[str, str], regions: set[str]) -> list[str]:
    """Row-parallel projections in the attention ``regions`` whose output width is a head count of that attention."""
    found = []
    for name, style_name in matched.items():
        region = _region_of(name, regions) if style_name == "rowwise" else None
        child = module.get_submodule(name)
        if region is not None and isinstance(child, nn.Linear):
            if child.out_features in head_counts(module.get_submodule(region)):
                found.append(name)
    return found


def per_head_parameters(module: nn.Module, regions: set[str], styled: set[str], tp: int) -> dict[str, list[str]]:
    """``{module: [parameter, ...]}``: plain parameters whose first dimension is a head count of the attention in
    ``regions`` holding them, in modules the plan does not style (projections and norms, which act on features,
    excluded)."""
    found: dict[str, list[str]] = {}
    for region in sorted(regions):
        counts = head_counts(module.get_submodule(region))
        if not counts:
            continue
        for name, child in module.get_submodule(region).named_modules(prefix=region):
            if name in styled or is_projection(child) or isinstance(child, nn.Embedding) or _is_norm(child):
                continue
            for leaf, param in child.named_parameters(recurse=False):
                if isinstance(param, DTensor) or param.dim() == 0 or param.shape[0] not in counts:
                    continue
                if param.shape[0] % tp == 0:  # the heads themselves are checked before training
                    found.setdefault(name, []).append(leaf)
    return found


def shard_per_head_parameters(module: nn.Module, regions: set[str], styled: set[str], mesh: DeviceMesh) -> list[str]:
    """Shard the per-head parameters (``per_head_parameters``) over heads; their modules run on the local shards.
    Returns their names."""
    found = per_head_parameters(module, regions, styled, mesh.size())
    for name, leaves in found.items():
        holder = module.get_submodule(name)
        for leaf in leaves:
            param = holder.get_parameter(leaf)
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
            holder.register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
        call = _LocalParameters(leaves)
        holder.register_forward_pre_hook(call.enter)
        holder.register_forward_hook(call.leave, always_call=True)
    return [f"{name}.{leaf}" if name else leaf for name, leaves in found.items() for leaf in leaves]


def split_per_head_inputs(module: nn.Module, regions: set[str], mesh: DeviceMesh) -> list[str]:
    """Arm ``_PerHeadInputs`` on the attention ``regions`` that know their head size; returns their names."""
    armed = []
    for region in sorted(regions):
        attention = module.get_submodule(region)
        head_dim = getattr(attention, "head_dim", None)
        if isinstance(head_dim, int) and head_counts(attention):
            widths = {count * head_dim for count in head_counts(attention)}
            attention.register_forward_pre_hook(_PerHeadInputs(widths, mesh), with_kwargs=True)
            armed.append(region)
    return armed


class _PerHeadInputs:
    """Forward pre-hook of an attention: a plain floating-point input with the hidden state's token dimensions,
    as wide as some of its heads (``widths``) and not as the hidden state, becomes this rank's heads' part."""

    def __init__(self, widths: set[int], mesh: DeviceMesh) -> None:
        self.widths = widths
        self.mesh = mesh

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        hidden = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        if hidden is None or isinstance(hidden, DTensor) or hidden.dim() < 2:
            return None
        tokens, width = tuple(hidden.shape[:-1]), hidden.shape[-1]

        def split(value: object) -> object:
            if (
                value is hidden
                or not torch.is_tensor(value)
                or isinstance(value, DTensor)
                or not value.is_floating_point()
                or tuple(value.shape[:-1]) != tokens
                or value.shape[-1] == width
                or value.shape[-1] not in self.widths
            ):
                return value
            whole = DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
            return whole.redistribute(placements=[Shard(value.dim() - 1)]).to_local()

        return tuple(split(a) for a in args), {k: split(v) for k, v in kwargs.items()}


class _LocalParameters:
    """A module's head-sharded parameters swapped for their local shards during its calls (differentiable views: the
    gradient reaches the DTensor). A stack: activation checkpointing re-enters the forward during backward."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.stack: list[dict[str, Any]] = []

    def enter(self, module: nn.Module, args: tuple) -> None:
        # Read at each call: module.to() and FSDP2's unsharded parameters are new tensors.
        params = {name: getattr(module, name) for name in self.names}
        local = {name: p.to_local() for name, p in params.items() if isinstance(p, DTensor)}
        self.stack.append(swap_parameters(module, local))

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.stack:
            restore_parameters(module, self.stack.pop())


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower()
