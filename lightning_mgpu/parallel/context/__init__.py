"""Context parallelism: each sequence split over ``cp`` ranks, attention exact by ring or all-to-all (Ulysses).

``check`` validates the options against a layout; ``apply`` makes one run's ``ContextParallel``: its batch
splitting and patches (attention, cross-entropy, positions, Hugging Face labels); ``ring_attention`` and
``alltoall_attention`` are the exact attention kernels; ``chunk_ids``, ``local_positions``, ``shard_sequence``
and ``unshard_sequence`` the load-balanced order of tokens over ranks.
"""

from lightning_mgpu.parallel.context.attention import alltoall_attention, ring_attention
from lightning_mgpu.parallel.context.checks import check
from lightning_mgpu.parallel.context.order import chunk_ids, local_positions, shard_sequence, unshard_sequence
from lightning_mgpu.parallel.context.runtime import ContextParallel, apply, check_module, check_sequence_length

__all__ = [
    "ContextParallel",
    "alltoall_attention",
    "apply",
    "check",
    "check_module",
    "check_sequence_length",
    "chunk_ids",
    "local_positions",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]
