"""The job the planner plans: the training setup (batch, precision) and the layout (a ``ParallelLayout`` with the
planner's other choices), with the tables they are checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.parallel import pipeline

# precision: (parameter, gradient, optimizer-state bytes per parameter (Adam: 2 states), activation bytes)
PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    "32-true": (4, 4, 8, 4),
    "bf16-mixed": (4, 4, 8, 2),
    "16-mixed": (4, 4, 8, 2),
    "bf16-true": (2, 2, 4, 2),
    "16-true": (2, 2, 4, 2),
    # torchao's float8 training: fp32 weights and states as bf16-mixed, 16-bit activations, fp8 matmuls
    "fp8-mixed": (4, 4, 8, 2),
}
# Every schedule the strategy runs (the runtime's one table, `parallel.pipeline`); the cost model has an
# activation-memory model for each (`cost.in_flight`, checked against torch's own action lists in the tests).
SCHEDULES = pipeline.PIPELINE_SCHEDULES


def stages_per_rank(schedule: str) -> int:
    """Stages per rank of a modelled schedule (``"none"``: no pipeline), as the runtime places them by default."""
    return 1 if schedule == "none" else pipeline.stages_per_rank(schedule, None)


CHECKPOINTING = ("none", "selective", "full")
DP_BUCKET_BYTES = 25 * 2**20  # one all-reduce bucket (DDP's default size); two are in flight


@dataclass(frozen=True)
class Training:
    global_batch: int
    precision: str = "bf16-mixed"
    flash_attention: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}.")
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(f"--global-batch must be a positive number of sequences, got {self.global_batch!r}.")


@dataclass(frozen=True)
class Layout(ParallelLayout):
    """A :class:`~lightning_mgpu.ParallelLayout` with what the planner chooses besides the sizes: pipeline schedule,
    microbatching, activation checkpointing, sequence parallelism, HSDP groups, the context-parallel mode and expert
    parallelism. Written by mesh-axis names: ``Layout.of(tp=8, pp=4, dp=2, zero_stage=1)``."""

    schedule: str = "none"
    microbatch_size: int = 1
    num_microbatches: int = 1
    checkpointing: str = "none"
    sequence_parallel: bool = False
    dp_shard: int | None = None  # HSDP: ZeRO shards over groups of this many dp ranks (None: all of dp)
    cp_mode: str = "ring"
    ep: int = 1  # expert parallelism: the routed experts split over groups of this many dp ranks

    @classmethod
    def of(cls, *, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, zero_stage: int = 0, **choices: Any) -> Layout:
        return cls(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            zero_stage=zero_stage,
            context_parallel_size=cp,
            **choices,
        )

    @property
    def shard(self) -> int:
        """The ranks ZeRO splits its states over: ``dp x cp``, or the hybrid-sharding group."""
        return self.dp_shard or self.gradient_ranks

    @property
    def replicas(self) -> int:
        return self.gradient_ranks // self.shard

    @property
    def expert_replicas(self) -> int:
        """The dp ranks holding the same experts under expert parallelism (``dp / ep``)."""
        return self.dp // self.ep

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.schedule)

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}", f"zero={self.zero_stage}"]
        if self.cp > 1:
            parts.insert(3, f"cp={self.cp}" + ("" if self.cp_mode == "ring" else f"({self.cp_mode})"))
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.shard != self.gradient_ranks:
            parts.append(f"hsdp={self.shard}")
        if self.pp > 1:
            parts.append(self.schedule)
        parts += [f"mbs={self.microbatch_size}x{self.num_microbatches}", f"ckpt={self.checkpointing}"]
        return " ".join(parts)

    def strategy_arguments(self) -> dict[str, Any]:
        """The ``HybridStrategy`` arguments that run this layout, every choice the prediction assumes spelled out
        (the options of a dimension of size 1 left out: the strategy refuses them there)."""
        arguments: dict[str, Any] = {
            "data_parallel_size": self.dp,
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "zero_stage": self.zero_stage,
        }
        if self.tp > 1:
            arguments["sequence_parallel"] = self.sequence_parallel
        if self.pp > 1:
            arguments |= {"pipeline_schedule": self.schedule, "num_microbatches": self.num_microbatches}
        if self.cp > 1:
            arguments |= {"context_parallel_size": self.cp, "context_parallel_mode": self.cp_mode}
        if self.ep > 1:
            arguments["expert_parallel_size"] = self.ep
        if self.dp_shard is not None and self.dp_shard != self.gradient_ranks:
            arguments["data_parallel_shard_size"] = self.dp_shard
        arguments["activation_checkpointing"] = _CHECKPOINTING_ARGUMENT[self.checkpointing]
        return arguments

    @property
    def loader_batch_size(self) -> int:
        """The DataLoader's batch size per data-parallel rank: a pipeline cuts its batch into the microbatches;
        without one each microbatch is a batch, accumulated (``global_batch_size``) up to the step's."""
        return self.microbatch_size * self.num_microbatches if self.pp > 1 else self.microbatch_size

    def as_dict(self) -> dict[str, Any]:
        """The planner's JSON form: the strategy's arguments, then the microbatch size it implies."""
        return self.strategy_arguments() | {"microbatch_size": self.microbatch_size}


_CHECKPOINTING_ARGUMENT = {"none": False, "full": "full", "selective": "selective"}
