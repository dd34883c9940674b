"""Restarts under torchrun's elastic agent (``--max-restarts`` > 0, ``--nnodes=MIN:MAX``): refused where they would
fail, before the process group exists.

By default torchrun shares one key-value store with the workers of every round (``TORCHELASTIC_USE_AGENT_STORE=True``:
the c10d rendezvous' rank-0 agent hosts it for as long as that agent lives; the static rendezvous, torchrun's default
without ``--rdzv-backend``, always). The workers of a restarted round then read the keys the previous round's
workers left: gloo connects to the dead ranks' addresses ("Connection refused" in ``connectFullMesh``, each attempt
using up a restart) or waits in process-group initialization with no message. A node joining a running job fails
in the agents' own rendezvous (torch 2.13's rank-0 agent publishes the shared store's address only in its first
round, so the new node's agent waits for it until the rendezvous times out, and the job's agents fail with it).
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment (with ``--rdzv-backend=c10d``) gives each round a
fresh store hosted by its rank 0.

Why not a key prefix per round, which would make the shared store safe: nothing a worker sees names its round.
``TORCHELASTIC_RESTART_COUNT`` is per agent (a node that joins later starts at 0 while the others count their
restarts) and does not count the restarts a node joining or leaving causes, so two consecutive rounds can show the
same counts everywhere; the rendezvous' round number lives in the rendezvous backend's store, whose address torchrun
does not give the workers (the shared store is another one, holding only what workers wrote); and agreeing on a
round through the shared store itself would need the liveness of whoever wrote the keys, the very thing a restart
cannot know. A prefix would also not help the joining node, whose agent fails before any worker starts. So an
elastic job on the shared store is refused at its start, on every rank, naming the variable.
"""

from __future__ import annotations

import os

_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


class ElasticStoreError(RuntimeError):
    """torchrun would restart this job's workers on one store shared by every round (see the module's text)."""


def restart_problem() -> str | None:
    """Why this torchrun job's restarts would fail, or None (no elastic agent, no restarts, or a fresh store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or "0"
    if int(restarts) == 0:
        return None
    static = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"  # set, yet shared: the static rendezvous
    fix = (
        f"the static rendezvous (no --rdzv-backend) ignores `{_FIX}`: add `--rdzv-backend=c10d`"
        " (`--standalone` on one node)"
        if static
        else f"start torchrun with `{_FIX}` in its environment and `--rdzv-backend=c10d` (as"
        " examples/elastic/torchrun.sh does)"
    )
    return (
        f"torchrun may restart this job (--max-restarts={restarts}) on one store shared by every round"
        f" (TORCHELASTIC_USE_AGENT_STORE=True): {fix} for a fresh store per round.\n"
        "On the shared store a restarted round reads the keys of the ranks that died (gloo's 'Connection refused',"
        " or a hang in process-group initialization) and a node joining later is never admitted; nothing a rank"
        " sees tells one round from another, so lightning-mgpu refuses the job before it could hang."
    )


def refuse_shared_store_restarts() -> None:
    """Raise :class:`ElasticStoreError` on every rank, before the process group, where torchrun's restarts would
    share one store (a warning is hidden by ``PYTHONWARNINGS=ignore`` and logging setups; a hang at 3 a.m. is not)."""
    problem = restart_problem()
    if problem is not None:
        raise ElasticStoreError(problem)
