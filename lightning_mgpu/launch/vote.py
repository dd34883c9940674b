"""After a failed run: may teardown still give the module back plain? Only when every rank failed in that run.

Gathering the module back is a collective. It is safe when no rank is left inside another collective, that is,
when every rank failed in the same run and reached its teardown (a user error every rank raises at the same step).
A rank whose error is its own (not a peer's echo: ``failures.is_secondary``) votes in the default process group's
store and waits a little for the others; a rank whose error is an echo, or whose wait runs out, decides "local".
The decision is written once (compare-and-set), so every rank of the run follows the same one in whatever order
they arrive, and a rank that fails much later (a survivor's collective timing out) reads "local" and never waits
on a collective its peers will not join.
"""

from __future__ import annotations

import itertools
import time

import torch.distributed as dist

from lightning_mgpu._compat.c10d import default_store
from lightning_mgpu.launch.failures import is_secondary

# Ranks failing at the same step reach their teardown this close together (the step's last collective lines them
# up); a rank failing alone waits this long before its report ends the job, so it stays short.
WAIT_S = 3.0
_GATHER = "gather"
_ROUNDS = itertools.count()  # one vote per failed run in this process: ranks that fail in the same run agree


def every_rank_failed(exception: BaseException, world_size: int, wait_s: float = WAIT_S) -> bool:
    """Whether every rank failed in this run (then teardown may run collectives). Never blocks past ``wait_s``."""
    if world_size == 1:
        return True
    if not (dist.is_available() and dist.is_initialized()):
        return False
    key = f"lightning_mgpu/failed_run/{next(_ROUNDS)}"
    try:
        store = default_store()
        proposal = "local"
        if isinstance(exception, Exception) and not is_secondary(exception):
            votes = store.add(f"{key}/votes", 1)
            deadline = time.monotonic() + wait_s
            # Until all have voted, the wait runs out, or another rank has decided (its error was an echo).
            while votes < world_size and time.monotonic() < deadline and not store.check([f"{key}/decision"]):
                time.sleep(0.05)
                votes = store.add(f"{key}/votes", 0)
            proposal = _GATHER if votes >= world_size else "local"
        decision = store.compare_set(f"{key}/decision", "", proposal)
    except Exception:  # noqa: BLE001 - the store went with a peer: nothing to agree with
        return False
    return bytes(decision).decode() == _GATHER
