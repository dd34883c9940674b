"""torch's ``nn.MultiheadAttention`` under tensor parallelism ('multihead_attention'): each rank computes the
attention of its own heads.

The module keeps its q, k and v projections in one packed parameter that no Linear holds (``in_proj_weight``, rows
``[q | k | v]``), reads its output projection's weight directly (``out_proj`` is never called) and calls
``F.multi_head_attention_forward``, which reshapes with the module's global head count. So the module is sharded
as a whole, the way Megatron-LM shards an attention:

- ``in_proj_weight`` chunk by chunk (``_StridedShard``: each rank holds the rows of its heads in q, k and v), the
  separate ``q/k/v_proj_weight`` of an attention with other key/value widths by rows, ``out_proj.weight`` by
  columns. Biases stay replicated (each rank uses its heads' part of ``in_proj_bias``, ``bias_k``, ``bias_v``; the
  output bias is added once, after the sum), as a fused projection's bias does (``styles.py``). Checkpoints and
  optimizers see the global parameters under their own names.
- While the module runs, its call of ``F.multi_head_attention_forward`` is computed on this rank's heads by
  ``_attention_on_local_heads``: the operations of torch's function (the same attention kernel) on fewer heads.
  Inputs enter replicated and leave with partial gradients (summed over the ranks in backward); the output
  projection's partial sums are all-reduced; attention weights (``need_weights=True``) are averaged over every
  rank's heads, or gathered per head.

Its forward needs no other communication, and the module's code (``batch_first``, masks, ``is_causal``) runs as
written; only the ``static_k``/``static_v`` arguments (never passed by the module itself) are refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_mgpu._compat.dtensor import StyleHooks, strided_shard
from lightning_mgpu.parallel.tensor.parameters import distribute_parameters

STYLE = "multihead_attention"
_QKV = 3


def is_multihead_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention)


class MultiheadAttentionParallel(StyleHooks, ParallelStyle):
    """'multihead_attention': an ``nn.MultiheadAttention`` sharded by heads (see the module docstring)."""

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_multihead_attention(module):
            raise ValueError(
                f"'{STYLE}' shards an nn.MultiheadAttention, not a {type(module).__name__}; give this module a"
                " projection style ('colwise', 'rowwise') or 'replicate'."
            )
        packed = {"in_proj_weight": strided_shard(0, _QKV), "in_proj_bias": Replicate()}
        separate = {name: Shard(0) for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight")}
        placements = {
            "": {**packed, **separate, "bias_k": Replicate(), "bias_v": Replicate()},
            "out_proj": {"weight": Shard(1), "bias": Replicate()},
        }

        def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            distribute_parameters(placements.get(name, {}), self.src_data_rank, name, submodule, mesh)

        distribute_module(module, device_mesh, partition)
        calls = _LocalHeadsCalls(device_mesh)
        module.register_forward_pre_hook(calls.enter)
        module.register_forward_hook(calls.leave, always_call=True)
        return module


class _LocalHeadsCalls:
    """Enters :class:`_LocalHeads` around the module's forward (a stack: activation checkpointing re-enters it)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.modes: list[_LocalHeads] = []

    def enter(self, module: nn.Module, args: tuple[object, ...]) -> None:
        mode = _LocalHeads(self.mesh)
        mode.__enter__()
        self.modes.append(mode)

    def leave(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if self.modes:
            self.modes.pop().__exit__(None, None, None)


class _LocalHeads(TorchFunctionMode):
    """``F.multi_head_attention_forward`` on this rank's heads; every other call as it is."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.multi_head_attention_forward:
            return _attention_on_local_heads(self.mesh, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _attention_on_local_heads(
    mesh: DeviceMesh,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    training: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    v_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    static_v: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward``'s result, computed on this rank's ``num_heads // tp`` heads."""
    if static_k is not None or static_v is not None:
        raise NotImplementedError(
            "nn.MultiheadAttention sharded by heads ('multihead_attention') does not take static_k/static_v; keep"
            " this attention whole with 'replicate' in `tp_plan`."
        )
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
    tgt_len, bsz, embed_dim = query.shape
    if embed_dim != embed_dim_to_check:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}")
    key_padding_mask = _float_mask(key_padding_mask, query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # the attention kernel applies the causal mask itself
    else:
        attn_mask = _float_mask(attn_mask, query.dtype)
        if key_padding_mask is not None:
            is_causal = False

    tp, rank = mesh.size(), mesh.get_local_rank()
    heads, head_dim = num_heads // tp, embed_dim // num_heads
    width = heads * head_dim  # this rank's share of the embedding
    entering = _Entering(mesh)
    biases = _local_chunks(entering.parameter(in_proj_bias), width, rank) if in_proj_bias is not None else None
    if use_separate_proj_weight:
        weights_qkv = (q_proj_weight, k_proj_weight, v_proj_weight)
        q, k, v = _separate_projections(entering, (query, key, value), weights_qkv, biases)
    else:
        assert in_proj_weight is not None  # as torch's function asserts
        q, k, v = _packed_projection(entering, query, key, value, _local(in_proj_weight), biases, width)
    src_len = key.shape[0]
    if attn_mask is not None:
        attn_mask = entering.tensor(attn_mask)
        if attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        else:  # (bsz * num_heads, tgt, src): this rank's heads
            per_head = attn_mask.view(bsz, num_heads, tgt_len, src_len)
            attn_mask = per_head[:, rank * heads : (rank + 1) * heads].reshape(bsz * heads, tgt_len, src_len)
    if bias_k is not None and bias_v is not None:
        local_k = entering.parameter(bias_k)[..., rank * width : (rank + 1) * width]
        local_v = entering.parameter(bias_v)[..., rank * width : (rank + 1) * width]
        k, v = torch.cat([k, local_k.repeat(1, bsz, 1)]), torch.cat([v, local_v.repeat(1, bsz, 1)])
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
    q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
    if add_zero_attn:
        zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
    src_len = k.size(1)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    dropout_p = dropout_p if training else 0.0

    weights = None
    if need_weights:
        scores = q * math.sqrt(1.0 / float(head_dim))
        keys = k.transpose(-2, -1)
        scores = torch.baddbmm(attn_mask, scores, keys) if attn_mask is not None else torch.bmm(scores, keys)
        probabilities = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            probabilities = F.dropout(probabilities, p=dropout_p)
        attended = torch.bmm(probabilities, v).transpose(0, 1).reshape(tgt_len * bsz, width)
        per_head = probabilities.view(bsz, heads, tgt_len, src_len)
        weights = _all_heads_weights(mesh, per_head, num_heads, average_attn_weights)
    else:
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(bsz, heads, -1, src_len)
        q, k, v = (t.view(bsz, heads, -1, head_dim) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        attended = attended.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, width)

    summed = DTensor.from_local(F.linear(attended, _local(out_proj_weight)), mesh, [Partial()], run_check=False)
    output = summed.redistribute(placements=[Replicate()]).to_local()
    if out_proj_bias is not None:
        output = output + _local(out_proj_bias)
    output = output.view(tgt_len, bsz, output.size(1))
    if not batched:
        output = output.squeeze(1)
        weights = weights.squeeze(0) if weights is not None else None
    return output, weights


def _packed_projection(
    entering: _Entering,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weight: torch.Tensor,
    biases: Any,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of this rank's heads from its rows ``[q | k | v]`` of ``in_proj_weight``: one projection per
    distinct input, as torch's packed projection makes them."""
    bias = torch.cat(biases) if biases is not None else None
    x_q = entering.tensor(query)
    if key is query and value is query:  # self-attention
        q, k, v = _parts(F.linear(x_q, weight, bias), _QKV, width)
        return q, k, v
    b_q, b_kv = (bias[:width], bias[width:]) if bias is not None else (None, None)
    q = F.linear(x_q, weight[:width], b_q)
    if value is key:  # cross-attention to one memory
        k, v = _parts(F.linear(entering.tensor(key), weight[width:], b_kv), 2, width)
        return q, k, v
    (w_k, w_v), (b_k, b_v) = weight[width:].chunk(2), b_kv.chunk(2) if b_kv is not None else (None, None)
    return q, F.linear(entering.tensor(key), w_k, b_k), F.linear(entering.tensor(value), w_v, b_v)


def _parts(projected: torch.Tensor, count: int, width: int) -> tuple[torch.Tensor, ...]:
    """A packed projection's output cut into its ``count`` parts, each contiguous (as torch's own cut makes them)."""
    parts = projected.unflatten(-1, (count, width)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    return tuple(parts[i] for i in range(count))


def _separate_projections(
    entering: _Entering,
    inputs: tuple[torch.Tensor, ...],
    weights: tuple[Any, ...],
    biases: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of this rank's heads from separate weights (keys or values of another width), sharded by rows."""
    biases = biases or (None, None, None)
    q, k, v = (F.linear(entering.tensor(x), _local(w), b) for x, w, b in zip(inputs, weights, biases, strict=True))
    return q, k, v


def _local_chunks(bias: torch.Tensor, width: int, rank: int) -> tuple[torch.Tensor, ...]:
    """This rank's heads' part of each of the q, k and v chunks of a whole packed bias."""
    return tuple(chunk[rank * width : (rank + 1) * width] for chunk in bias.chunk(_QKV))


def _all_heads_weights(mesh: DeviceMesh, local: torch.Tensor, num_heads: int, average: bool) -> torch.Tensor:
    """The attention weights of every rank's heads: averaged over all heads, or all of them (``[bsz, heads, ...]``)."""
    if average:
        summed = local.sum(dim=1) / num_heads
        return DTensor.from_local(summed, mesh, [Partial()], run_check=False).full_tensor()
    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False).full_tensor()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive float mask torch's attention makes of it (``-inf`` where ``True``)."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


class _Entering:
    """Values every rank holds whole, entering the computation of this rank's heads: their gradients are this
    rank's share, summed over the ranks in backward (a column-parallel layer's input). Each distinct tensor is
    converted once, so that q, k and v read from one input sum their shares before the collective."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._converted: dict[int, torch.Tensor] = {}

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        if not value.requires_grad:
            return value
        converted = self._converted.get(id(value))
        if converted is None:
            whole = DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
            converted = self._converted[id(value)] = whole.to_local(grad_placements=[Partial()])
        return converted

    def parameter(self, param: torch.Tensor) -> torch.Tensor:
        """A replicated parameter of which this rank uses its heads' part."""
        if isinstance(param, DTensor):
            return param.to_local(grad_placements=[Partial()])
        return self.tensor(param)
