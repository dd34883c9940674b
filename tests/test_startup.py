"""A run's start under ``init_timeout`` (``launch/startup.py``): a rank still starting names its phase and the likely
cause and ends; a SIGTERM from the launcher meanwhile gets the same line, even while the main thread waits in C++.

The bound's thread and its messages are tested in this process; the SIGTERM path in a forked child, which blocks in
a TCPStore wait (C++, where no Python signal handler runs) as a rank in process-group initialization does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mgpu import HybridStrategy
from lightning_mgpu.launch import ElasticStoreError, free_port
from lightning_mgpu.launch.startup import CHECKPOINT_LOAD, PROCESS_GROUP, RESTORE, StartupBound

DESCRIBE = lambda rank: f"pp 0, dp {rank}, tp 0"


def _bound(timeout_s: float, expired: list[str]) -> StartupBound:
    return StartupBound(timeout_s, 1, 4, DESCRIBE, on_expired=expired.append).start()


def _wait_for(expired: list[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not expired and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_rank_still_starting_after_the_bound_names_its_phase_and_the_likely_cause(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    expired: list[str] = []
    started = time.monotonic()
    bound = _bound(0.4, expired)
    with bound.phase(CHECKPOINT_LOAD, then=RESTORE):
        _wait_for(expired, 3)
    assert 0.4 <= time.monotonic() - started < 2.0
    (message,) = expired
    assert message.startswith("lightning-mgpu: rank 1 of 4 (pp 0, dp 1, tp 0) still in loading the checkpoint after 0")
    assert "(init_timeout=0.4 s): reading the checkpoint takes longer than the bound" in message
    assert message.endswith("Rank 1 ends so that its launcher can end or restart the job.")
    bound.stop()


def test_process_group_initialization_on_torchruns_shared_store_names_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    expired: list[str] = []
    bound = _bound(0.2, expired)  # the bound starts in process-group initialization
    _wait_for(expired, 3)
    assert expired and "still in process-group initialization" in expired[0], expired
    assert "TORCHELASTIC_USE_AGENT_STORE=True" in expired[0]
    assert "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`" in expired[0]
    bound.stop()


def test_a_start_that_ends_in_time_says_nothing():
    expired: list[str] = []
    bound = _bound(0.3, expired)
    bound.stop()  # the first loop started
    time.sleep(0.6)
    assert not expired


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a rank")
def test_a_sigterm_while_blocked_in_a_store_wait_prints_the_phase_then_ends_the_rank():
    """torchrun stops a node's other ranks once one ended: a rank blocked in C++ still says where it was."""
    read, write = os.pipe()
    port = free_port()
    pid = os.fork()
    if pid == 0:  # the rank: its stderr to the pipe, then a wait no other process will answer
        try:
            sys.stderr = os.fdopen(write, "w")  # where the bound prints (pytest's capture is the parent's)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))
            bound = StartupBound(30, 3, 4, DESCRIBE, listen_for_sigterm=True).start()
            with bound.phase(PROCESS_GROUP, then=RESTORE):
                print("waiting", file=sys.stderr, flush=True)
                store.wait(["never set"])
        finally:
            os._exit(7)
    os.close(write)
    with os.fdopen(read) as stderr:
        assert stderr.readline() == "waiting\n"
        time.sleep(0.3)  # inside the C++ wait by now
        os.kill(pid, signal.SIGTERM)
        started = time.monotonic()
        _, status = os.waitpid(pid, 0)
        output = stderr.read()
    assert time.monotonic() - started < 5
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGTERM, output
    assert output.startswith(
        "lightning-mgpu: rank 3 of 4 (pp 0, dp 3, tp 0) stopped by SIGTERM during process-group initialization"
    ), output
    assert output.count("lightning-mgpu:") == 1, output


def test_init_timeout_is_checked_before_any_process_starts():
    with pytest.raises(ValueError, match=r"`init_timeout` must be a positive number of seconds or None"):
        HybridStrategy(init_timeout=-1)
    HybridStrategy(init_timeout=None)


def test_an_elastic_job_on_torchruns_shared_store_is_refused_before_its_process_group(monkeypatch):
    """As a rank torchrun started with --max-restarts=3 and its default store: refused in setup_environment."""
    elastic = {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0"}
    elastic |= {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    elastic |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    for name, value in elastic.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), logger=False, max_steps=1)
    with pytest.raises(ElasticStoreError, match=r"torchrun may restart this job \(--max-restarts=3\)"):
        trainer.fit(BoringModel())
    assert not dist.is_initialized()
