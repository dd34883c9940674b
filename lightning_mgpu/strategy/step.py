"""Where a step of the user's module runs: through the data-parallel root's ``__call__``, or through the pipeline
schedule, inside the tensor-parallel context the step needs."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.context import ContextParallel
from lightning_mgpu.parallel.pipeline import PipelineEngine
from lightning_mgpu.parallel.tensor import tensor_parallel_context


def step_context(layout: ParallelLayout, options: ParallelOptions, method_name: str) -> AbstractContextManager:
    """Sequence and loss parallelism for one step or its backward.

    Predictions keep whole logits: loss parallelism serves steps that compute a loss, and their backward.
    """
    tp = layout.tensor_parallel_size > 1
    loss_parallel = options.loss_parallel and tp and method_name != "predict_step"
    return tensor_parallel_context(options.sequence_parallel and tp, loss_parallel)


def run_step(
    model: nn.Module | None,
    pipeline: PipelineEngine | None,
    context_parallel: ContextParallel | None,
    module: Any,
    context: AbstractContextManager,
    method_name: str,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """``method_name`` of the user's ``module`` (a LightningModule) on this rank's part of the batch (with context
    parallelism: its part of each sequence)."""
    if context_parallel is None:
        return _run(model, pipeline, module, context, method_name, args, kwargs)
    args = context_parallel.split(method_name, args)
    return context_parallel.finish(method_name, _run(model, pipeline, module, context, method_name, args, kwargs))


def _run(
    model: nn.Module | None,
    pipeline: PipelineEngine | None,
    module: Any,
    context: AbstractContextManager,
    method_name: str,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    if pipeline is not None:
        if kwargs:
            raise TypeError(f"Under pipeline parallelism {method_name} is called with positional arguments only.")
        with context:
            if method_name == "training_step":
                accumulate = module.trainer.accumulate_grad_batches
                return pipeline.training_step(*args, accumulate_grad_batches=accumulate)
            return pipeline.evaluation_step(method_name, *args)
    # Through the root wrapper's __call__ so the data-parallel hooks fire even when the step calls a submodule
    # directly (`self.model(input_ids=x)`).
    assert model is not None  # the StepRunner, or the DeepSpeed engine around it
    with context:
        return model(method_name, *args, **kwargs)
