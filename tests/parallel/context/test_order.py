"""The load-balanced order of tokens over context-parallel ranks."""

from __future__ import annotations

import torch

from lightning_mgpu.parallel.context import chunk_ids, local_positions, shard_sequence, unshard_sequence


def test_each_rank_holds_an_early_and_a_late_chunk_and_together_every_token_once():
    cp, seq_len = 4, 32
    assert [chunk_ids(cp, rank) for rank in range(cp)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    positions = [local_positions(seq_len, cp, rank) for rank in range(cp)]
    assert positions[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq_len))
    # Under a causal mask every rank's queries see the same number of keys in total.
    keys_seen = [int((p + 1).sum()) for p in positions]
    assert len(set(keys_seen)) == 1, keys_seen


def test_shard_and_unshard_are_inverse_along_any_dim():
    tensor = torch.arange(2 * 3 * 16).reshape(2, 16, 3)
    for cp in (1, 2, 4):
        shards = [shard_sequence(tensor, 1, cp, rank) for rank in range(cp)]
        assert all(shard.shape == (2, 16 // cp, 3) for shard in shards)
        assert torch.equal(unshard_sequence(shards, 1), tensor)
