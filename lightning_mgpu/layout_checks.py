"""The checks a layout and the strategy's options pass before any process starts, in the strategy's words: the
strategy runs them when it and the Trainer are built (``strategy.layout_choice``, ``strategy.batch``), the planner on
each layout it ranks (``planner.recipe``), so that the two never disagree.
"""

from __future__ import annotations

from lightning_mgpu.backends import deepspeed
from lightning_mgpu.layout import ParallelLayout, Size
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import context, data, pipeline, tensor
from lightning_mgpu.parallel.experts import check_expert_layout
from lightning_mgpu.precision import check_precision_layout

_SIZE_NAMES = ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")


def check_options(
    options: ParallelOptions,
    zero_stage: Size,
    tensor_parallel_size: Size,
    pipeline_parallel_size: Size,
    context_parallel_size: int = 1,
) -> None:
    """Every parallelism's checks of its own options, against the sizes as given (``"auto"`` ones are judged per
    candidate layout by :func:`check_sizes`). Raised when the strategy is built, before any process starts."""
    options.check_implemented()
    tensor.check(options)
    pipeline.check(options)
    options.check_sizes(
        zero_stage, tensor_parallel_size, pipeline_parallel_size, context_parallel_size=context_parallel_size
    )
    _check_with_sizes(options, zero_stage, tensor_parallel_size, pipeline_parallel_size)


def check_sizes(
    options: ParallelOptions, precision: str, requested_sizes: tuple[Size | None, ...], layout: ParallelLayout
) -> None:
    """The options and the Trainer's ``precision`` against one layout's sizes (raises naming the option and the
    fix)."""
    auto = tuple(name for name, size in zip(_SIZE_NAMES, requested_sizes) if size == "auto")
    sizes = (layout.zero_stage, layout.tensor_parallel_size, layout.pipeline_parallel_size)
    options.check_sizes(*sizes, auto, context_parallel_size=layout.context_parallel_size)
    _check_with_sizes(options, *sizes)
    data.check(options, layout)
    context.check(options, layout)
    if layout.expert_parallel_size > 1:
        check_expert_layout(options, layout)
    check_precision_layout(precision, layout.tensor_parallel_size)


def _check_with_sizes(options: ParallelOptions, zero_stage: Size, tensor_size: Size, pipeline_size: Size) -> None:
    if isinstance(pipeline_size, int):
        pipeline.check_microbatches(options, pipeline_size)
    deepspeed.check(options, zero_stage, tensor_size, pipeline_size)


def accumulation_for(global_batch_size: int, per_rank_batch: int, data_parallel_size: int, requested: int) -> int:
    """Micro-batches per optimizer step that make ``global_batch_size`` samples; raises naming the numbers where
    they do not divide, or where the Trainer's own ``accumulate_grad_batches`` says otherwise."""
    per_step = per_rank_batch * data_parallel_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of the samples one micro-batch step takes:"
            f" {per_rank_batch} per data-parallel rank x {data_parallel_size} data-parallel ranks = {per_step}."
            f" Choose a global_batch_size that {per_step} divides, or a per-rank batch size (the DataLoader's"
            f" batch_size) that divides global_batch_size / {data_parallel_size}."
        )
    accumulate = global_batch_size // per_step
    if requested not in (1, accumulate):
        raise ValueError(
            f"Trainer(accumulate_grad_batches={requested}) contradicts global_batch_size={global_batch_size}, which"
            f" needs {accumulate} here ({per_rank_batch} per rank x {data_parallel_size} ranks). Remove one of them."
        )
    return accumulate
