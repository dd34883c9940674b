"""Run a function in N gloo processes, fast and with a hard deadline.

Workers are forked from the test process (torch is already imported, so a job costs ~1 s instead of ~7 s) and
limited to one intra-op thread each: a forked child that uses the parent's warmed OpenMP pool can hang. A job
that does not finish in time is killed and fails its test alone, naming the ranks that did not report.
"""

from __future__ import annotations

import gc
import importlib
import io
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_mgpu.launch import free_port  # also imported from here by the torchrun tests

DEFAULT_TIMEOUT = 240.0


@contextmanager
def one_rank_group(device: str = "cpu") -> Iterator[Any]:
    """A process group of this process alone (gloo; NCCL for CUDA tensors when ``device`` is ``"cuda"``), gone
    afterwards; within a group already there, that one."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets; Lightning then treats the processes as launched externally."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
    }


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, queue: Any, args: tuple, kwargs: dict
) -> None:
    os.environ.update(torchrun_env(rank, world_size, port))
    # Lightning's launcher sets cpu_count // processes intra-op threads where OMP_NUM_THREADS is unset: a one-process
    # fit then ran on every core, and OpenMP's spinning threads cost 5-20x the work's CPU on a loaded machine.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    inherited = set(sys.modules)
    try:
        result = fn(*args, **kwargs)
        # Serialize here: tensors sent through a Queue as shared memory die with this process.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue(), sorted(set(sys.modules) - inherited)))
    except BaseException:  # report everything, including KeyboardInterrupt-like exits
        queue.put((rank, False, traceback.format_exc(), []))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _import_here(names: list[str]) -> None:
    """Import what a child had to import itself, so that later children inherit it instead (Hugging Face model
    classes pull in hundreds of modules lazily: ~0.5 s of CPU per rank and job)."""
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # a module that only imports in a child's state is simply imported there again
                pass


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked ranks with torchrun-style environment variables.

    Returns the results ordered by rank. Raises with the failing rank's traceback, or ``TimeoutError`` naming the
    ranks that had not finished after ``timeout`` seconds.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    processes = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, queue, args, kwargs), daemon=True)
        for rank in range(world_size)
    ]
    # Frozen objects are left out of the children's garbage collections: a full collection in a child (teardown
    # runs one) would otherwise walk, and so copy, every page of the parent's heap (~1-3 s per rank and fit).
    gc.freeze()
    try:
        for process in processes:
            process.start()
    finally:
        gc.unfreeze()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            try:
                rank, ok, value, imported = queue.get(timeout=min(remaining, 1.0))
            except Exception:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {processes[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            _import_here(imported)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return [results[rank] for rank in range(world_size)]


def run_each(checks: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run every check in this rank, one after the other, so that one job serves many tests; a check that raises
    is kept as ``{"failed": traceback}`` for its own test to report (``traceback_of``)."""
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
    return results


def traceback_of(result: Any) -> str | None:
    """The traceback ``run_each`` kept for a check that raised, else None."""
    return result["failed"] if isinstance(result, dict) and "failed" in result else None
