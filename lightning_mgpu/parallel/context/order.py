"""Which tokens of a sequence each context-parallel rank holds: the load-balanced (head-tail) order.

The sequence is cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``: under a causal
mask an early chunk attends to few keys and a late one to many, so every rank gets the same work (torchtitan's and
Megatron's order). Pure functions of sizes: the runtime and the tests share them.
"""

from __future__ import annotations

import torch


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 cp``) rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s ``seq_len / cp`` tokens, in its order."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp, rank)])


def shard_sequence(tensor: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``tensor`` along ``dim`` (a copy, contiguous)."""
    positions = local_positions(tensor.shape[dim], cp, rank, tensor.device)
    return tensor.index_select(dim, positions)


def unshard_sequence(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's shard (in rank order): the inverse of :func:`shard_sequence`."""
    cp = len(shards)
    seq_len = sum(shard.shape[dim] for shard in shards)
    order = torch.cat([local_positions(seq_len, cp, rank, shards[0].device) for rank in range(cp)])
    return torch.cat(shards, dim=dim).index_select(dim, torch.argsort(order))
