"""DeepSpeed as the ZeRO engine (``zero_backend="deepspeed"``): its config built from the Trainer's arguments
(``config``), the engine run behind Lightning's hooks (``engine``), its partitions read and written in the same
checkpoint format as the torch backend (``states``), and the plain module given back at teardown (``release``).

DeepSpeed itself is imported only when an engine is built: the package works without it installed.
"""

from lightning_mgpu.backends.deepspeed.config import build_config, check_config
from lightning_mgpu.backends.deepspeed.engine import (
    CHECKPOINT_KEY,
    DeepSpeedEngineRunner,
    check,
    check_requested,
    memory_per_rank,
    zero_bytes_per_param,
)
from lightning_mgpu.backends.deepspeed.states import DeepSpeedStates

__all__ = [
    "CHECKPOINT_KEY",
    "DeepSpeedEngineRunner",
    "DeepSpeedStates",
    "build_config",
    "check",
    "check_config",
    "check_requested",
    "memory_per_rank",
    "zero_bytes_per_param",
]
