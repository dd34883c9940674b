"""The job the planner plans: the training setup (batch, precision) and the candidate layout (the strategy's
``ParallelLayout`` and ``ParallelOptions``, with the planner's own microbatching), with the tables they are checked
against."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import pipeline
from lightning_mgpu.parallel.activation import Recomputation, recomputation

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
# The activation_checkpointing values the planner ranks and prints (True and a list of classes are "full"), by what
# they recompute, as --fix names them (ckpt=none|selective|full).
CHECKPOINTING_ARGUMENTS: dict[str, bool | str] = {recomputation(mode): mode for mode in (False, "selective", "full")}
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
class Microbatching:
    """How one data-parallel rank cuts its share of the global batch, the planner's own choice (the strategy has
    no argument for it: Lightning's batch size and ``global_batch_size`` imply it): ``count`` microbatches of
    ``size`` sequences, a pipeline's microbatches under one (``num_microbatches``), accumulated steps without."""

    size: int = 1
    count: int = 1


def microbatching_for(layout: ParallelLayout, options: ParallelOptions, global_batch: int) -> Microbatching:
    """What the strategy runs with these options: as many microbatches as stages where ``num_microbatches`` is
    None under a pipeline, one batch per rank without one."""
    count = (options.num_microbatches or layout.pp * _stages_per_rank(layout, options)) if layout.pp > 1 else 1
    return Microbatching(size=max(1, global_batch // layout.dp // count), count=count)


def _stages_per_rank(layout: ParallelLayout, options: ParallelOptions) -> int:
    """Stages per rank as the runtime places them: 1 without a pipeline (pp=1 leaves the options at defaults)."""
    return pipeline.stages_per_rank(options.pipeline_schedule, options.stages_per_rank) if layout.pp > 1 else 1


@dataclass(frozen=True)
class Layout(ParallelLayout):
    """A candidate the planner ranks: the strategy's :class:`~lightning_mgpu.ParallelLayout` and
    :class:`~lightning_mgpu.ParallelOptions`, in the strategy's own words, with the planner's :class:`Microbatching`
    beside them. Options along a dimension of size 1 stay at their defaults, as the strategy requires."""

    options: ParallelOptions = field(default_factory=ParallelOptions)
    microbatching: Microbatching = Microbatching()

    @classmethod
    def from_strategy(cls, layout: ParallelLayout, options: ParallelOptions, microbatching: Microbatching) -> Layout:
        """The candidate for what the strategy resolved (its layout and options), cut into ``microbatching``."""
        sizes = {f.name: getattr(layout, f.name) for f in fields(ParallelLayout)}
        return cls(**sizes, options=options, microbatching=microbatching)

    @classmethod
    def of(
        cls,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        cp: int = 1,
        ep: int = 1,
        zero_stage: int = 0,
        dp_shard: int | None = None,
        options: ParallelOptions | None = None,
        microbatching: Microbatching = Microbatching(),
    ) -> Layout:
        """By mesh-axis names, as ``ParallelLayout`` reads them: ``Layout.of(tp=8, pp=4, dp=2, zero_stage=1)``."""
        return cls(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            zero_stage=zero_stage,
            context_parallel_size=cp,
            expert_parallel_size=ep,
            data_parallel_shard_size=dp_shard,
            options=options or ParallelOptions(),
            microbatching=microbatching,
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
        return _stages_per_rank(self, self.options)

    @property
    def recomputation(self) -> Recomputation:
        """What backward recomputes, as the strategy reads ``activation_checkpointing``."""
        return recomputation(self.options.activation_checkpointing)

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}", f"zero={self.zero_stage}"]
        mode = self.options.context_parallel_mode
        if self.cp > 1:
            parts.insert(3, f"cp={self.cp}" + ("" if mode == "ring" else f"({mode})"))
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.shard != self.gradient_ranks:
            parts.append(f"hsdp={self.shard}")
        if self.pp > 1:
            parts.append(self.options.pipeline_schedule)
        parts += [f"mbs={self.microbatching.size}x{self.microbatching.count}", f"ckpt={self.recomputation}"]
        return " ".join(parts)

    def strategy_arguments(self) -> dict[str, Any]:
        """The ``HybridStrategy`` arguments that run this layout, every choice the prediction assumes spelled out
        (the options of a dimension of size 1 left out: the strategy refuses them there)."""
        options = self.options
        arguments: dict[str, Any] = {
            "data_parallel_size": self.dp,
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "zero_stage": self.zero_stage,
        }
        if self.tp > 1:
            arguments["sequence_parallel"] = options.sequence_parallel
        if self.pp > 1:
            arguments |= {"pipeline_schedule": options.pipeline_schedule, "num_microbatches": self.microbatching.count}
            if options.stages_per_rank is not None:
                arguments["stages_per_rank"] = options.stages_per_rank
        if self.cp > 1:
            arguments |= {"context_parallel_size": self.cp, "context_parallel_mode": options.context_parallel_mode}
        if self.ep > 1:
            arguments["expert_parallel_size"] = self.ep
        if self.dp_shard is not None and self.dp_shard != self.gradient_ranks:
            arguments["data_parallel_shard_size"] = self.dp_shard
        arguments["activation_checkpointing"] = CHECKPOINTING_ARGUMENTS[self.recomputation]
        return arguments

    @property
    def loader_batch_size(self) -> int:
        """The DataLoader's batch size per data-parallel rank: a pipeline cuts its batch into the microbatches;
        without one each microbatch is a batch, accumulated (``global_batch_size``) up to the step's."""
        size, count = self.microbatching.size, self.microbatching.count
        return size * count if self.pp > 1 else size

    def as_dict(self) -> dict[str, Any]:
        """The planner's JSON form: the strategy's arguments, then the microbatch size it implies."""
        return self.strategy_arguments() | {"microbatch_size": self.microbatching.size}
