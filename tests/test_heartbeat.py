"""The heartbeat: a rank that stops without failing is named and the job ended within ``heartbeat_timeout``."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_mgpu import HybridStrategy
from lightning_mgpu.launch.heartbeat import Heartbeat


def _pair(timeout_s: float):
    store = dist.HashStore()
    lost: list[str] = []
    describe = lambda r: f"dp {r}"
    watcher = Heartbeat(store, 0, 2, timeout_s, describe, on_lost=lost.append)
    watched = Heartbeat(store, 1, 2, timeout_s, describe, on_lost=lost.append)
    watched._run_index = watcher._run_index  # the same run on both "ranks" (one process here)
    return watcher, watched, lost


def test_a_rank_whose_beat_stops_is_named_within_the_timeout():
    watcher, watched, lost = _pair(0.6)
    watched.store.add(watched._key(1), 1)  # rank 1 beat once, then stopped (its thread never runs)
    started = time.monotonic()
    watcher.start()
    while not lost and time.monotonic() - started < 5:
        time.sleep(0.05)
    watcher.stop()
    assert lost and "rank 1 of 2 (dp 1) stopped responding" in lost[0], lost
    assert 0.6 <= time.monotonic() - started < 2.0  # the timeout plus a beat or two


def test_beating_ranks_and_a_rank_whose_run_ended_first_are_not_taken_for_lost():
    watcher, watched, lost = _pair(0.6)
    watcher.start(), watched.start()
    time.sleep(1.5)  # more than twice the timeout, both beating
    assert not lost
    watched.stop()  # its fit ended: it says so before its beat stops
    time.sleep(1.5)
    watcher.stop()
    assert not lost


def test_heartbeat_timeout_is_checked_before_any_process_starts():
    with pytest.raises(ValueError, match=r"`heartbeat_timeout` must be a positive number of seconds or None"):
        HybridStrategy(heartbeat_timeout=0)
    HybridStrategy(heartbeat_timeout=None, timeout=timedelta(seconds=30))
