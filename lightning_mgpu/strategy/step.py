"""Where a step of the user's module runs: through the data-parallel root's ``__call__``, or through the pipeline
schedule, inside the tensor-parallel context the step needs; and the strategy's step hooks (``StepHooks``: the four
steps, backward, the optimizer step and gradient accumulation) that call it."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor, nn
from typing_extensions import override

from lightning_mgpu.backends.deepspeed import DeepSpeedEngineRunner
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.context import ContextParallel
from lightning_mgpu.parallel.data import finish_backward, prepare_backward, set_gradient_sync
from lightning_mgpu.parallel.local_step import fused_on_cpu
from lightning_mgpu.parallel.pipeline import PipelineEngine
from lightning_mgpu.parallel.tensor import tensor_parallel_context
from lightning_mgpu.strategy.setup import data_parallel_roots, shard_gathered
from lightning_mgpu.strategy.weights import check_first_loss

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mgpu.planner.auto import StrategyPlan


class StepHooks(ParallelStrategy):
    """Mixed into ``HybridStrategy``, which sets the step runner (``model``), the pipeline engine, context
    parallelism, the DeepSpeed runner and the planner's plan."""

    _pipeline: PipelineEngine | None
    _context: ContextParallel | None
    _deepspeed: DeepSpeedEngineRunner | None
    _plan: StrategyPlan | None
    _first_loss_checked: bool | None  # None: nothing to check; False: check the next training step's loss
    options: ParallelOptions

    if TYPE_CHECKING:

        @property
        def layout(self) -> ParallelLayout: ...

    @property
    def _data_parallel_roots(self) -> list[nn.Module]:
        """The modules data parallelism wrapped: the step runner, or this rank's pipeline stages."""
        return data_parallel_roots(self._pipeline, self.model)

    def _step(self, method_name: str, *args: object, **kwargs: object) -> Any:
        context = self._tensor_parallel_context(method_name)
        parallel = (self.model, self._pipeline, self._context)
        return run_step(*parallel, self.lightning_module, context, method_name, args, kwargs)

    @override
    def training_step(self, *args: object, **kwargs: object) -> Any:
        if self._plan is not None:
            self._plan.step_clock.tick()
        with self.precision_plugin.train_step_context():
            output = self._step("training_step", *args, **kwargs)
        if self._first_loss_checked is False:  # the strategy filled the weights: the first loss must be a number
            self._first_loss_checked = True
            check_first_loss(output)
        return output

    @override
    def validation_step(self, *args: object, **kwargs: object) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: object, **kwargs: object) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: object, **kwargs: object) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        _shard_after_evaluation(self._data_parallel_roots)

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        _shard_after_evaluation(self._data_parallel_roots)

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        _shard_after_evaluation(self._data_parallel_roots)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: object, **kwargs: object) -> Tensor:
        if self._pipeline is not None:
            # The schedule already ran backward inside `training_step`; callbacks still get on_after_backward.
            assert self.lightning_module is not None
            return Precision.post_backward(self.precision_plugin, closure_loss, self.lightning_module)
        if self._deepspeed is not None:
            assert self.lightning_module is not None
            return self._deepspeed.backward(closure_loss, self.lightning_module, self.precision_plugin)
        with self._tensor_parallel_context():
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        finish_backward(self._data_parallel_roots)  # DDP: parameters left without a gradient, before the step
        return loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:  # `manual_backward` runs inside the root's forward
            prepare_backward(self._data_parallel_roots, closure_loss)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], object], model: Any = None, **kwargs: object) -> Any:
        if self._deepspeed is not None:
            assert self.lightning_module is not None
            return self._deepspeed.optimizer_step(optimizer, closure, self.lightning_module)
        # Adam/AdamW on plain CPU tensors step with torch's fused kernel where the user chose neither foreach nor fused.
        with fused_on_cpu(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _tensor_parallel_context(self, method_name: str = "training_step") -> AbstractContextManager:
        return step_context(self.layout, self.options, method_name)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the non-final micro-steps of ``accumulate_grad_batches``."""
        for root in self._data_parallel_roots:
            set_gradient_sync(root, False)
        if self._pipeline is not None:
            self._pipeline.sync_gradients = False
        try:
            yield
        finally:
            for root in self._data_parallel_roots:
                set_gradient_sync(root, True)
            if self._pipeline is not None:
                self._pipeline.sync_gradients = True


def _shard_after_evaluation(roots: list[nn.Module]) -> None:
    """An evaluation loop's forwards leave FSDP2 groups that reshard only after backward (ZeRO-2, the root's
    embeddings and head at ZeRO-3, FSDP2's replicate) gathered: the module then holds gathered copies, not the
    sharded parameters the optimizers point at, and callbacks that compare the two between epochs
    (``BaseFinetuning``'s unfreezing) met plain tensors beside DTensors. Sharded again, as before the loop."""
    shard_gathered(roots)


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
    module: Any,  # the strategy's lightning_module: typed Optional by Lightning, set by now
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
    module: pl.LightningModule,
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
