"""Restarts under torchrun's elastic agent (``--max-restarts`` > 0, ``--nnodes=MIN:MAX``).

By default torchrun's c10d rendezvous shares one key-value store with the workers of every round
(``TORCHELASTIC_USE_AGENT_STORE=True``), and the workers of a restart read the keys the previous round's workers
left: gloo then connects to the dead ranks' addresses ("Connection refused" in ``connectFullMesh``) and the restart
fails, again and again. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment gives each round a
fresh store (its rank 0 hosts it). Nothing in a worker can tell a stale key from a fresh one, so the agent's setting
is the fix; this module says so before the first restart needs it.
"""

from __future__ import annotations

import os
import warnings

_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def restart_problem() -> str | None:
    """Why this torchrun job's restarts would fail, or None (no elastic agent, no restarts, or a fresh store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) == 0:
        return None
    return (
        f"torchrun may restart this job (--max-restarts={os.environ['TORCHELASTIC_MAX_RESTARTS']}), but its"
        " rendezvous shares one store with the workers of every round: a restart's ranks would read the addresses"
        " of the ranks that died and fail to connect. Start torchrun with"
        f" `{_FIX}` in its environment (examples/elastic/torchrun.sh does) for a fresh store per round."
    )


def warn_about_restarts(global_rank: int) -> None:
    """Warn once per job (global rank 0) where torchrun's restarts would fail."""
    problem = restart_problem()
    if problem is not None and global_rank == 0:
        warnings.warn(problem, stacklevel=2)
