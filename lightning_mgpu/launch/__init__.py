"""Starting the ranks and ending them well: Lightning's launchers with one clear report when a rank fails
(``launchers``), what torchrun's restarts need (``elastic``), what a failed rank records and how the report reads
under any launcher (``failures``), a run's start under a bound (``startup``), a rank that stops responding
(``heartbeat``), whether every rank failed (``vote``), and a rendezvous port (``ports``)."""

from lightning_mgpu.launch.elastic import ElasticStoreError, refuse_shared_store_restarts
from lightning_mgpu.launch.failures import (
    RankFailedError,
    coordinates,
    describe_rank,
    handle_rank_failure,
    restore_sigterm,
)
from lightning_mgpu.launch.heartbeat import Heartbeat
from lightning_mgpu.launch.launchers import HybridMultiProcessingLauncher, HybridSubprocessScriptLauncher
from lightning_mgpu.launch.ports import free_port
from lightning_mgpu.launch.startup import StartupBound
from lightning_mgpu.launch.vote import every_rank_failed

__all__ = [
    "ElasticStoreError",
    "Heartbeat",
    "HybridMultiProcessingLauncher",
    "HybridSubprocessScriptLauncher",
    "RankFailedError",
    "StartupBound",
    "coordinates",
    "describe_rank",
    "every_rank_failed",
    "free_port",
    "handle_rank_failure",
    "refuse_shared_store_restarts",
    "restore_sigterm",
]
