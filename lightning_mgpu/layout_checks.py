"""The checks a layout and the strategy's options pass before any process starts, in the strategy's words: the
strategy runs them when it and the Trainer are built (``strategy.layout_choice``, ``strategy.batch``), the planner on
each layout it ranks (``planner.recipe``), so that the two never disagree.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_mgpu.backends import deepspeed
from lightning_mgpu.layout import ParallelLayout, Size
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import context, data, experts, pipeline, tensor
from lightning_mgpu.precision import check_precision_layout

_SIZE_NAMES = ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")
# Every parallelism's `check(layout, options)`, in the order their refusals are said.
_CHECKS: tuple[Callable[[ParallelLayout, ParallelOptions], None], ...] = (
    tensor.check,
    pipeline.check,
    deepspeed.check,
    data.check,
    context.check,
    experts.check,
)


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
    tensor.check_options(options)
    pipeline.check_options(options)
    options.check_sizes(
        zero_stage, tensor_parallel_size, pipeline_parallel_size, context_parallel_size=context_parallel_size
    )
    if isinstance(pipeline_parallel_size, int):
        pipeline.check_microbatches(options, pipeline_parallel_size)
    deepspeed.check_requested(options, zero_stage, tensor_parallel_size, pipeline_parallel_size)


def check_sizes(
    options: ParallelOptions, precision: str, requested_sizes: tuple[Size | None, ...], layout: ParallelLayout
) -> None:
    """The options and the Trainer's ``precision`` against one layout's sizes (raises naming the option and the
    fix): the rule for options of a dimension of size 1, then each parallelism's ``check(layout, options)``."""
    auto = tuple(name for name, size in zip(_SIZE_NAMES, requested_sizes) if size == "auto")
    sizes = (layout.zero_stage, layout.tensor_parallel_size, layout.pipeline_parallel_size)
    options.check_sizes(*sizes, auto, context_parallel_size=layout.context_parallel_size)
    for check in _CHECKS:
        check(layout, options)
    check_precision_layout(precision, layout.tensor_parallel_size)


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
