"""The strategy's non-size options, validated once, before any process starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union


PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ZERO_BACKENDS = ("torch", "deepspeed")
CHECKPOINT_FORMATS = ("sharded", "full")
ACTIVATION_CHECKPOINTING = (False, True, "full", "selective")


@dataclass(frozen=True)
class ParallelOptions:
    """How each parallelizer works (the layout says how many ways)."""

    zero_backend: str = "torch"
    tp_plan: Union[str, dict[str, str], Callable[..., None]] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    pipeline_schedule: str = "1F1B"
    num_microbatches: Optional[int] = None
    stages_per_rank: Optional[int] = None
    pipeline_split: Union[str, list[str]] = "auto"
    activation_checkpointing: Union[bool, str, list[type]] = False
    cpu_offload: bool = False
    checkpoint_format: str = "sharded"
    async_checkpoint: bool = False

    def __post_init__(self) -> None:
        _one_of("zero_backend", self.zero_backend, ZERO_BACKENDS)
        _one_of("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        _one_of("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        if not (self.tp_plan == "auto" or isinstance(self.tp_plan, dict) or callable(self.tp_plan)):
            raise ValueError(
                f"`tp_plan` must be 'auto', a dict {{module_glob: style}} or a callable (module, tp_mesh),"
                f" got {self.tp_plan!r}."
            )
        if isinstance(self.tp_plan, dict):
            from lightning_mgpu.parallel.tensor_plan import STYLE_NAMES

            unknown = {glob: s for glob, s in self.tp_plan.items() if s not in STYLE_NAMES}
            if unknown:
                raise ValueError(f"`tp_plan` has unknown styles {unknown}; use one of {list(STYLE_NAMES)}.")
        if not (self.pipeline_split == "auto" or _is_list_of_str(self.pipeline_split)):
            raise ValueError(
                f"`pipeline_split` must be 'auto' or a list of module names where stages begin,"
                f" got {self.pipeline_split!r}."
            )
        if self.num_microbatches is not None and not _positive_int(self.num_microbatches):
            raise ValueError(f"`num_microbatches` must be a positive integer or None, got {self.num_microbatches!r}.")
        if self.stages_per_rank is not None and not _positive_int(self.stages_per_rank):
            raise ValueError(f"`stages_per_rank` must be a positive integer or None, got {self.stages_per_rank!r}.")
        ac = self.activation_checkpointing
        if not (ac in ACTIVATION_CHECKPOINTING or (isinstance(ac, (list, tuple)) and all(isinstance(c, type) for c in ac))):
            raise ValueError(
                f"`activation_checkpointing` must be False, True, 'full', 'selective' or a list of module classes,"
                f" got {ac!r}."
            )
        for name in ("sequence_parallel", "loss_parallel", "cpu_offload", "async_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.async_checkpoint and self.checkpoint_format != "sharded":
            raise ValueError(
                "`async_checkpoint=True` writes sharded checkpoints in the background and needs"
                f" `checkpoint_format='sharded'`, got {self.checkpoint_format!r}."
            )

    def check_implemented(self) -> None:
        """Refuse, loudly, options this version accepts in its signature but does not implement yet."""
        pending = {
            "zero_backend='deepspeed'": self.zero_backend == "deepspeed",
        }
        missing = [name for name, requested in pending.items() if requested]
        if missing:
            raise NotImplementedError(
                f"HybridStrategy does not implement {', '.join(missing)} yet in this version; see the CHANGELOG"
                " for what is available. Remove the argument(s) to train with data parallelism and ZeRO."
            )

    def check_sizes(self, zero_stage: int, tensor_parallel_size: Any) -> None:
        """Options that need a given ZeRO stage or tensor-parallel size."""
        if self.loss_parallel and tensor_parallel_size == 1:
            raise ValueError(
                "`loss_parallel=True` keeps the LM head's logits sharded over the vocabulary across tensor-parallel"
                " ranks and needs tensor_parallel_size > 1, got 1. Set tensor_parallel_size or drop loss_parallel."
            )
        if self.cpu_offload and zero_stage != 3:
            raise ValueError(
                f"`cpu_offload=True` offloads sharded parameters, gradients and optimizer states (FSDP2's"
                f" CPUOffloadPolicy) and needs zero_stage=3, got zero_stage={zero_stage}."
            )


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, allowed))}, got {value!r}.")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_list_of_str(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, str) for v in value)
