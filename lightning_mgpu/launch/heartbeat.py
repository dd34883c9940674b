"""A rank that stops responding ends the job in seconds, not after the collective timeout.

A rank stopped by the system (SIGSTOP, a stuck driver, a frozen node) fails no collective: the others wait in theirs
until ``timeout`` (30 minutes by default), and an elastic agent sees no failure to restart from. Each rank's
thread therefore counts up a key of its own in the process group's store every ``timeout / 6`` seconds and watches
the key of the next rank (a ring: each rank reads one key per beat, whatever the world size). A counter that has
not moved for ``timeout`` seconds names that rank in one line, and the watching rank ends its process: the others'
collectives then fail at once, and the launcher (torchrun, SLURM, ours) ends or restarts the job. Counters are
compared with the watcher's own monotonic clock, so the nodes' clocks need not agree. The beat is a thread and
runs while the main thread computes, compiles or writes a checkpoint; only a stopped process misses it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_KEY = "lightning_mgpu/heartbeat/{run}/{rank}"
_runs = 0  # fits, validations ... of this process: every rank runs the same sequence, so they agree on the keys


class Heartbeat:
    """This rank's beat and its watch over the next rank; ``stop()`` ends both (teardown)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        describe: Callable[[int], str],
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.watched = (rank + 1) % world_size
        self.describe = describe
        self.on_lost = on_lost or _end_process
        global _runs
        _runs += 1
        self._run_index = _runs
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-mgpu-heartbeat", daemon=True)

    def _key(self, rank: int) -> str:
        return _KEY.format(run=self._run_index, rank=rank)

    def start(self) -> Heartbeat:
        self.store.add(self._key(self.rank), 1)  # the first beat before any rank starts watching
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the beat and the watch; a rank whose run ended before its watcher's is not taken for lost."""
        self._stopped.set()
        try:
            self.store.set(self._key(self.rank) + "/done", "1")
        except Exception:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = self.timeout_s / 6
        mine, watched = self._key(self.rank), self._key(self.watched)
        last_count, last_change = None, time.monotonic()
        while not self._stopped.wait(interval):
            try:
                self.store.add(mine, 1)
                count = self.store.add(watched, 0)  # reads the counter (0 until that rank's first beat)
            except Exception:  # the store is gone: the job is ending anyway
                return
            now = time.monotonic()
            if count != last_count:
                last_count, last_change = count, now
            elif now - last_change > self.timeout_s and not self._stopped.is_set():
                if _finished(self.store, watched):
                    return  # its run ended first: nothing left to watch
                self.on_lost(
                    f"lightning-mgpu: rank {self.watched} of {self.world_size} ({self.describe(self.watched)}) stopped"
                    f" responding: no heartbeat for {now - last_change:.0f} s (heartbeat_timeout={self.timeout_s:g} s)."
                    f" Rank {self.rank} ends the job so that its launcher can end or restart it."
                )
                return


def _finished(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key + "/done"]))
    except Exception:
        return False


def _end_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)  # from a thread: the main thread may be blocked in a collective with the lost rank
