"""Global-shape tensor-parallel regions: the modules between column- and row-parallel layers see unsharded shapes.

Code such as nanoGPT's attention reads sizes from the (unsharded) input and from its config::

    B, T, C = x.size()
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    ...
    y = y.transpose(1, 2).contiguous().view(B, T, C)

With plain per-rank shards every one of those numbers would have to be the local one. Instead, inside a region
(the parent of column-parallel projections: an attention, an MLP) the projections hand back DTensors with the
*global* shape, sharded over heads/features, so ``size()``, ``split``, ``view``, ``transpose`` and attention see
exactly the shapes the author wrote, whatever names the numbers come from. DTensor propagates the sharding
(``Shard`` on the merged ``C`` dimension becomes ``Shard`` on the heads dimension after ``view``), and the
row-parallel projection at the end takes the DTensor as it is. Three things DTensor alone would do expensively or
not at all are done here, all without communication, by a ``TorchFunctionMode`` active while the region's
``forward`` runs:

- ``split``/``chunk`` of a fused ``[q | k | v]`` output into its chunks. The fused projection is sharded chunk by
  chunk (``_StridedShard``), so each rank already holds its heads' q, k and v; DTensor would all-gather the output
  to split it. Here each chunk is cut from the local shard and becomes a DTensor sharded on the same dimension.
- ``F.scaled_dot_product_attention`` on inputs sharded over heads (DTensor has no sharding rule for the CPU
  kernel): attention is independent per head, so it runs on the local heads (a mask with a heads dimension is
  cut to the local heads).
- ``torch.cat`` with a plain 1-d empty tensor (a key/value cache's start): left out, as plain ``torch.cat`` does.
- ``std``/``var`` over a sharded dimension (Gemma 3n's activation sparsity): DTensor computes them, but their
  backward modifies a partial gradient in place, which DTensor refuses; composed of ``mean`` and ``sum`` here.
- plain tensors mixed with DTensors (a causal-mask buffer, rotary ``cos``/``sin``, an unsharded parameter): every
  tensor-parallel rank holds the same plain values, so they enter as replicated DTensors. Done at this level,
  autograd records DTensor operations, so backward needs no context of its own.

Everything else is DTensor's own semantics, which keep the global tensor exact: an operation the author wrote
that DTensor can only do by redistributing is still correct, just slower (tests count the collectives).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import GetSetDescriptorType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from lightning_mgpu._compat.dtensor import is_strided_shard, strided_chunks
from lightning_mgpu._compat.tensors import tree_map

if TYPE_CHECKING:
    from lightning_mgpu._compat.dtensor import _StridedShard

_SPLITS = (torch.Tensor.split, torch.split, torch.Tensor.split_with_sizes, torch.Tensor.chunk, torch.chunk)
_MOMENTS = (torch.std, torch.Tensor.std, torch.var, torch.Tensor.var)
_CONCATS = (torch.cat, torch.concat, torch.concatenate)
_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@torch.compiler.disable
def _strided_layout(placement: _StridedShard) -> tuple[int, int]:
    """``(split_factor, dim)`` of a ``_StridedShard``, read outside ``torch.compile``'s tracing (dynamo cannot read
    the attributes of torch's placement objects inside a torch-function mode): a graph break under compile=True."""
    return strided_chunks(placement), placement.dim


class GlobalShapeMode(TorchFunctionMode):
    """Active during a region's forward: local fused splits and attention, plain tensors entering as replicated."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Attribute reads (``x.shape``, ``x.grad``; about half of a region's calls) have nothing to convert.
        if isinstance(getattr(func, "__self__", None), GetSetDescriptorType):
            return func(*args, **kwargs)
        dtensor, plain = _scan(args, kwargs)
        if dtensor is None:
            return func(*args, **kwargs)
        if func in _CONCATS:
            args, kwargs = _without_legacy_empties(args, kwargs)
        if func in _SPLITS:
            parts = _split_fused(func, args, kwargs)
            if parts is not None:
                return parts
        elif func is F.scaled_dot_product_attention:
            return _attention_on_local_heads(args, kwargs)
        elif func in _MOMENTS:
            moment = _moment_over_shards(func in (torch.std, torch.Tensor.std), args, kwargs)
            if moment is not None:
                return moment
        if plain:
            mesh = dtensor.device_mesh
            args, kwargs = tree_map(lambda a: _replicated(a, mesh) if _is_plain(a) else a, (args, kwargs))
        return func(*args, **kwargs)


def _scan(args: tuple, kwargs: dict) -> tuple[DTensor | None, bool]:
    """The first DTensor among the arguments (and in lists of them, as ``torch.cat`` takes), and whether plain
    tensors are mixed in. Runs on every operation in a region, hence no general tree flattening."""
    dtensor, plain = None, False
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor):
                dtensor = value if dtensor is None else dtensor
            elif value.dim() > 0:
                plain = True
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, DTensor):
                    dtensor = item if dtensor is None else dtensor
                elif _is_plain(item):
                    plain = True
    return dtensor, plain


def _is_plain(value: object) -> bool:
    # 0-d tensors DTensor already treats as scalars.
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0


def _replicated(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)


_warned: set = set()


def _without_legacy_empties(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``torch.cat`` skips plain 1-d empty tensors whatever the others' shapes (a cache's first keys: Hugging Face's
    ``DynamicLayer`` starts from ``torch.tensor([])``); DTensor's concatenation does not, so they are left out."""
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)):
        return args, kwargs
    kept = [t for t in tensors if isinstance(t, DTensor) or not (t.dim() == 1 and t.numel() == 0)]
    if len(kept) == len(tensors):
        return args, kwargs
    if args:
        return (kept, *args[1:]), kwargs
    return args, {**kwargs, "tensors": kept}


def _split_fused(func: Callable[..., object], args: tuple, kwargs: dict) -> tuple | None:
    """``split``/``chunk`` of a chunk-wise sharded fused projection into its chunks: cut from the local shard."""
    tensor = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if not isinstance(tensor, DTensor) or len(tensor.placements) != 1:
        return None
    placement = tensor.placements[0]  # a _StridedShard once checked: split_factor, dim
    if not is_strided_shard(placement):
        return None
    chunked = func in (torch.Tensor.chunk, torch.chunk)
    names = ("chunks",) if chunked else ("split_size", "split_size_or_sections", "split_sizes")
    sizes = args[1] if len(args) > 1 else next((kwargs[n] for n in names if n in kwargs), None)
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    dim %= tensor.dim()
    factor, placed = _strided_layout(placement)
    total = tensor.shape[dim]
    if dim != placed % tensor.dim():
        return None
    if chunked:
        matches = sizes == factor
    elif isinstance(sizes, int):
        matches = sizes * factor == total
    else:
        matches = sizes is not None and len(sizes) == factor and all(size * factor == total for size in sizes)
    if not matches:
        key = (tuple(tensor.shape), str(sizes))
        if key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"A fused projection sharded as {factor} equal chunks (tp_plan style 'colwise_qkv') is split into"
                f" {sizes} along dim {dim} of {tuple(tensor.shape)}: DTensor gathers it to split it (correct, but one"
                " all-gather per call). Give the parts their own projections or a plan that shards them as used.",
                stacklevel=3,
            )
        return None
    local = tensor.to_local()
    return tuple(
        DTensor.from_local(part, tensor.device_mesh, [Shard(dim)], run_check=False) for part in local.chunk(factor, dim)
    )


def _moment_over_shards(std: bool, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``std``/``var`` of a DTensor over a dimension it is sharded on, as ``mean`` and ``sum`` (whose backward
    DTensor runs); ``None`` for any other call (left to DTensor)."""
    tensor, rest = args[0], list(args[1:])
    if not isinstance(tensor, DTensor) or "out" in kwargs:
        return None
    unbiased = rest.pop(0) if rest and isinstance(rest[0], bool) else kwargs.get("unbiased", True)
    dim = rest.pop(0) if rest else kwargs.get("dim")
    unbiased = rest.pop(0) if rest else unbiased
    keepdim = rest.pop(0) if rest else kwargs.get("keepdim", False)
    correction = kwargs.get("correction", 1 if unbiased else 0)
    dims = range(tensor.dim()) if dim is None else [dim] if isinstance(dim, int) else dim
    dims = sorted({d % tensor.dim() for d in dims})
    sharded = {p.dim % tensor.dim() for p in tensor.placements if isinstance(p, Shard)}
    if not sharded & set(dims) or not isinstance(correction, (int, float)):
        return None
    count = 1
    for d in dims:
        count *= tensor.shape[d]
    centered = tensor - tensor.mean(dim=dims, keepdim=True)
    variance = (centered * centered).sum(dim=dims, keepdim=keepdim) / max(0, count - correction)
    return variance.sqrt() if std else variance


def _attention_on_local_heads(args: tuple, kwargs: dict) -> DTensor:
    """``F.scaled_dot_product_attention`` per head on this rank's heads (heads are independent)."""
    bound = dict(zip(_SDPA_ARGUMENTS, args))
    bound.update(kwargs)
    query, key, value = bound.pop("query"), bound.pop("key"), bound.pop("value")
    mesh = next(t for t in (query, key, value) if isinstance(t, DTensor)).device_mesh
    heads_dim = query.dim() - 3
    tp = mesh.size()
    heads = [t.shape[heads_dim] for t in (query, key, value)]
    # Sharded over heads when every head count divides (checked before training); replicated otherwise.
    target = [Shard(heads_dim)] if mesh.ndim == 1 and all(h % tp == 0 for h in heads) else [Replicate()] * mesh.ndim
    local = []
    for tensor in (query, key, value):
        if not isinstance(tensor, DTensor):
            tensor = _replicated(tensor, mesh)
        if tuple(tensor.placements) != tuple(target):
            tensor = tensor.redistribute(placements=target)
        local.append(tensor.to_local())
    mask = bound.get("attn_mask")
    if isinstance(mask, DTensor):
        mask = mask.full_tensor()
    if mask is not None and target[0] != Replicate() and mask.dim() >= 3 and mask.size(-3) > 1:
        if mask.requires_grad:
            # Computed from parameters every rank holds whole (T5's relative position bias): cut as a replicated
            # DTensor, so that backward gathers the other heads' gradients and the parameters stay identical.
            mask = _replicated(mask, mesh).redistribute(placements=[Shard(mask.dim() - 3)]).to_local()
        else:
            per_rank = mask.size(-3) // tp
            mask = mask.narrow(mask.dim() - 3, mesh.get_local_rank() * per_rank, per_rank)
    bound["attn_mask"] = mask
    local_query, local_key, local_value = local
    out = F.scaled_dot_product_attention(local_query, local_key, local_value, **bound)
    return DTensor.from_local(out, mesh, target, run_check=False)


class GlobalShapeRegion:
    """Enters :class:`GlobalShapeMode` around one module's forward (hooks; left also when forward raises)."""

    def __init__(self) -> None:
        self.modes: list[GlobalShapeMode] = []

    def enter(self, module: nn.Module, args: tuple[object, ...]) -> None:
        mode = GlobalShapeMode()
        mode.__enter__()
        self.modes.append(mode)

    def exit(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if self.modes:
            self.modes.pop().__exit__(None, None, None)


def install_global_shape_region(module: nn.Module) -> None:
    region = GlobalShapeRegion()
    module.register_forward_pre_hook(region.enter)
    module.register_forward_hook(region.exit, always_call=True)
