"""Ranks that failed agree, without a collective, whether their teardown may gather the module back."""

from __future__ import annotations

import time

import torch.distributed as dist

from lightning_mgpu.launch.vote import every_rank_failed
from tests.helpers.distributed import run_distributed


def _votes() -> dict[str, object]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    own, echo = ValueError("the user's bug"), RuntimeError("Connection reset by peer")
    out: dict[str, object] = {"together": every_rank_failed(own, 2)}
    # One rank's own error, the other's an echo of it: no collective.
    start = time.monotonic()
    out["echo"] = every_rank_failed(own if rank == 0 else echo, 2)
    out["echo_s"] = time.monotonic() - start  # rank 0 stops waiting once rank 1 has decided
    # Rank 0 fails alone: its wait runs out and it decides; rank 1, failing later in the same run, reads that.
    if rank == 1:
        time.sleep(1.5)
    start = time.monotonic()
    out["alone"] = every_rank_failed(own, 2, wait_s=0.5)
    out["alone_s"] = time.monotonic() - start
    dist.barrier()
    out["not_an_exception"] = every_rank_failed(KeyboardInterrupt() if rank == 0 else own, 2)
    return out


def test_ranks_agree_and_never_wait_on_a_rank_that_did_not_fail():
    results = run_distributed(_votes, 2)
    for rank, result in enumerate(results):
        assert result["together"] is True, (rank, result)
        assert result["echo"] is False and result["alone"] is False, (rank, result)
        assert result["not_an_exception"] is False, (rank, result)
        assert result["alone_s"] < 1.0, (rank, result)  # rank 1 reads rank 0's decision at once
        assert result["echo_s"] < 2.0, (rank, result)  # not the whole wait
