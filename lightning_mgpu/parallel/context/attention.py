"""Exact attention over a sequence split across the context-parallel group: ring and all-to-all (Ulysses).

Every rank holds two chunks of each sequence in the load-balanced order (``order.py``): chunks ``r`` and
``2 cp - 1 - r`` of ``2 cp``. Causal attention then costs every rank the same.

- **Ring** (:func:`ring_attention`): key/value blocks travel around the group, one hop per step; each rank
  attends its queries to the block it holds (per chunk pair: whole, causal on the diagonal, or skipped above it)
  and merges the partial outputs by their log-sum-exp. The backward pass sends the blocks around once more, their
  key/value gradients travelling with them and arriving home after one last hop. Any head count works; memory is
  one block more than the local shard.
- **All-to-all** (:func:`alltoall_attention`, DeepSpeed-Ulysses): one all-to-all turns "all heads, local tokens"
  into "local heads, all tokens", attention runs on the whole sequence as one block (:func:`block_attention`), and
  a second all-to-all turns it back. Needs the (local) heads divisible by cp.

Every block, in both modes, runs on the kernel ``kernels.kernel_for`` chooses: torch's fused kernels that return the
log-sum-exp (flash, memory-efficient or cuDNN on CUDA, flash on CPU; ``_compat/attention.py``), the same math in
torch ops where none applies. Partial results merge in fp32. Both modes are exact: the same softmax over the same
keys as one process, to the kernel's rounding.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mgpu._compat.attention import fused_attention, fused_attention_backward
from lightning_mgpu._compat.c10d import all_to_all
from lightning_mgpu.parallel.context.kernels import kernel_for
from lightning_mgpu.parallel.context.order import chunk_ids

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def ring_attention(
    query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: float | None, group: ProcessGroup
) -> Tensor:
    """Attention of this rank's queries to every rank's keys and values (``(B, H, T_local, D)`` each; keys and values
    may have fewer heads, grouped-query attention)."""
    return _RingAttention.apply(query, key, value, is_causal, scale, group)


def alltoall_attention(
    query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: float | None, group: ProcessGroup, sdpa: Any
) -> Tensor:
    """Ulysses: heads scattered, the whole sequence gathered, ``sdpa`` on it (:func:`block_attention` in training,
    or any function called like SDPA), and back."""
    cp = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % cp:  # each rank's query heads need their own key/value heads: repeat the groups first
        key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
    order = _natural_order(cp, query.shape[2] // 2, query.device)
    gathered = [_heads_to_sequence(t, cp, group).index_select(2, order) for t in (query, key, value)]
    gqa = {"enable_gqa": True} if gathered[1].shape[1] != gathered[0].shape[1] else {}
    out = sdpa(*gathered, is_causal=is_causal, scale=scale, **gqa)
    back = out.index_select(2, torch.argsort(order))
    return _sequence_to_heads(back, cp, group)


def block_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """SDPA on one whole block through the kernel the ring's blocks use (:func:`kernel_for`): the all-to-all's
    attention over the gathered sequence. Grouped-query heads follow from the shapes (``enable_gqa`` is SDPA's)."""
    return _BlockAttention.apply(query, key, value, is_causal, scale)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: float | None):  # type: ignore[no-untyped-def]
        out, lse = _attention(query, key, value, is_causal, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor):  # type: ignore[no-untyped-def]
        query, key, value, out, lse = ctx.saved_tensors
        grads = _attention_backward(grad_out, query, key, value, out, lse, ctx.is_causal, ctx.scale)
        return *(g.to(t.dtype) for g, t in zip(grads, (query, key, value))), None, None


def _heads_to_sequence(tensor: Tensor, cp: int, group: ProcessGroup) -> Tensor:
    """``(B, H, T_local, D)`` -> ``(B, H / cp, cp * T_local, D)``: head group ``g`` to rank ``g``, tokens in rank
    order."""
    b, h, t, d = tensor.shape
    chunks = tensor.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()  # (cp, B, H/cp, T, D)
    received = all_to_all(chunks, group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _sequence_to_heads(tensor: Tensor, cp: int, group: ProcessGroup) -> Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    b, h, tokens, d = tensor.shape
    t = tokens // cp
    chunks = tensor.reshape(b, h, cp, t, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, T, D)
    received = all_to_all(chunks, group)
    return received.transpose(0, 1).reshape(b, cp * h, t, d)


def _natural_order(cp: int, chunk: int, device: torch.device) -> Tensor:
    """Indices that put the all-to-all's rank-ordered tokens (each rank's two chunks) into sequence order."""
    rank_ordered = [c for rank in range(cp) for c in chunk_ids(cp, rank)]
    position = {c: i for i, c in enumerate(rank_ordered)}
    return torch.cat([torch.arange(chunk, device=device) + position[c] * chunk for c in range(2 * cp)])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[no-untyped-def]
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        is_causal: bool,
        scale: float | None,
        group: ProcessGroup,
    ):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        half = query.shape[2] // 2
        queries = (query[:, :, :half], query[:, :, half:])
        outs: list[Tensor | None] = [None, None]
        lses: list[Tensor | None] = [None, None]
        block = torch.cat([key.reshape(-1), value.reshape(-1)])
        for step in range(cp):
            owner = (rank - step) % cp
            pending = _pass_on(block, group) if step < cp - 1 else None
            keys, values = _split_block(block, key, value)
            for (i, q), (_, k, v), causal in _pairs(queries, keys, values, cp, rank, owner, is_causal):
                out, lse = _attention(q, k, v, causal, scale)
                outs[i], lses[i] = _merge(outs[i], lses[i], out, lse)
            if pending is not None:
                block = pending()
        out = torch.cat([o.to(query.dtype) for o in outs], dim=2)  # type: ignore[union-attr]
        lse = torch.cat(lses, dim=2)  # type: ignore[arg-type]
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.is_causal, ctx.scale, ctx.group = is_causal, scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor):  # type: ignore[no-untyped-def]
        query, key, value, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        half = query.shape[2] // 2
        split = lambda t: (t[:, :, :half], t[:, :, half:])
        queries, outs, lses, grads = split(query), split(out), split(lse), split(grad_out.contiguous())
        grad_query = torch.zeros_like(query, dtype=torch.float32)
        grad_queries = split(grad_query)
        block = torch.cat([key.reshape(-1), value.reshape(-1)])
        grad_block = torch.zeros(block.numel(), dtype=torch.float32, device=block.device)
        for step in range(cp):
            owner = (rank - step) % cp
            pending = _pass_on(block, group) if step < cp - 1 else None
            keys, values = _split_block(block, key, value)
            grad_keys, grad_values = _split_block(grad_block, key, value)
            for (i, q), (j, k, v), causal in _pairs(queries, keys, values, cp, rank, owner, ctx.is_causal):
                dq, dk, dv = _attention_backward(grads[i], q, k, v, outs[i], lses[i], causal, ctx.scale)
                grad_queries[i].add_(dq)
                grad_keys[j].add_(dk)
                grad_values[j].add_(dv)
            grad_block = _pass_on(grad_block, group)()  # with its block, or home after the last step
            if pending is not None:
                block = pending()
        grad_key, grad_value = (torch.cat(parts, dim=2) for parts in _split_block(grad_block, key, value))
        return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None


def _pairs(queries: tuple, keys: tuple, values: tuple, cp: int, rank: int, owner: int, is_causal: bool) -> list:
    """The (query chunk, key/value chunk) pairs one step computes: ``((i, q), (j, k, v), causal)``; a key chunk
    after the query chunk is skipped under a causal mask, the diagonal is causal, the rest attends to everything."""
    pairs = []
    for i, query_chunk in enumerate(chunk_ids(cp, rank)):
        for j, key_chunk in enumerate(chunk_ids(cp, owner)):
            if is_causal and key_chunk > query_chunk:
                continue
            causal = is_causal and key_chunk == query_chunk
            pairs.append(((i, queries[i]), (j, keys[j], values[j]), causal))
    return pairs


def _split_block(block: Tensor, key: Tensor, value: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The flat ``[key | value]`` message as each tensor's two sequence chunks (views)."""
    k, v = block[: key.numel()].view(key.shape), block[key.numel() :].view(value.shape)
    half = key.shape[2] // 2
    return (k[:, :, :half], k[:, :, half:]), (v[:, :, :half], v[:, :, half:])


def _pass_on(tensor: Tensor, group: ProcessGroup) -> Any:
    """Send ``tensor`` to the next rank of the ring and receive the previous rank's; returns a wait for the result,
    so that the transfer overlaps the attention of the block at hand."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:
        return lambda: tensor  # a ring of one rank: the block is home already
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group),
    ]
    works = dist.batch_isend_irecv(ops)

    def wait() -> Tensor:
        for work in works:
            work.wait()
        return received

    return wait


def _merge(out: Tensor | None, lse: Tensor | None, new_out: Tensor, new_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax results over disjoint keys, combined as one softmax over both (in fp32)."""
    new_out, new_lse = new_out.float(), new_lse.float()
    if out is None or lse is None:
        return new_out, new_lse
    merged = torch.logaddexp(lse, new_lse)
    return out * torch.exp(lse - merged).unsqueeze(-1) + new_out * torch.exp(new_lse - merged).unsqueeze(-1), merged


def _attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    """One block's output (in ``q``'s dtype) and fp32 log-sum-exp, through the kernel ``kernel_for`` chooses."""
    choice = kernel_for(q, k, v, causal)
    if choice.kernel == "math":
        return _math_attention(q, k, v, causal, scale)
    k, v = (_repeat_heads(t, q.shape[1]) if choice.expand_heads else t for t in (k, v))
    return fused_attention(choice.kernel, q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)


def _attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's query, key and value gradients given the merged ``out`` and ``lse``, on the forward's kernel."""
    choice = kernel_for(q, k, v, causal)
    if choice.kernel == "math":
        return _math_attention_backward(grad, q, k, v, out, lse, causal, scale)
    kv_heads = k.shape[1]
    k, v = (_repeat_heads(t, q.shape[1]) if choice.expand_heads else t for t in (k, v))
    grad_q, grad_k, grad_v = fused_attention_backward(
        choice.kernel, grad.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
        lse.contiguous(), causal, scale,
    )  # fmt: skip
    return grad_q, _fold_heads(grad_k, kv_heads), _fold_heads(grad_v, kv_heads)


def _repeat_heads(tensor: Tensor, heads: int) -> Tensor:
    """Grouped key/value heads repeated to ``heads`` (query head ``i`` reads key/value head ``i // groups``)."""
    return tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _fold_heads(grad: Tensor, heads: int) -> Tensor:
    """The gradient of :func:`_repeat_heads`: each key/value head's repeats summed."""
    return grad if grad.shape[1] == heads else grad.unflatten(1, (heads, grad.shape[1] // heads)).sum(2)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float | None) -> Tensor:
    """fp32 ``q k^T * scale`` with grouped key heads repeated and the causal mask applied (square blocks)."""
    k = _repeat_heads(k, q.shape[1])
    scores = (q.float() @ k.float().transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _math_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    with _without_autocast(q.device.type):
        scores = _scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        v = _repeat_heads(v, q.shape[1])
        return (torch.exp(scores - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def _math_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Flash attention's backward for one block given the merged ``out`` and ``lse`` (Dao et al., 2022, Alg. 2)."""
    with _without_autocast(q.device.type):
        return _math_backward(grad, q, k, v, out, lse, causal, scale)


def _without_autocast(device_type: str) -> Any:
    """The math path's fp32 matmuls stay fp32 under a mixed-precision step's autocast, which would cast them down."""
    return torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else nullcontext()


def _math_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    factor = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    probs = torch.exp(_scores(q, k, causal, scale) - lse.float().unsqueeze(-1))
    grad, k_full, v_full = grad.float(), _repeat_heads(k.float(), q.shape[1]), _repeat_heads(v.float(), q.shape[1])
    grad_v = probs.transpose(-2, -1) @ grad
    grad_probs = grad @ v_full.transpose(-2, -1)
    rowsum = (grad * out.float()).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - rowsum) * factor
    grad_q = grad_scores @ k_full
    grad_k = grad_scores.transpose(-2, -1) @ q.float()
    return grad_q, _fold_heads(grad_k, k.shape[1]), _fold_heads(grad_v, k.shape[1])
