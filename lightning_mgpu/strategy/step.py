"""Where a step of the user's module runs: through the data-parallel root's ``__call__``, or through the pipeline
schedule, inside the tensor-parallel context the step needs; and the strategy's step hooks (``StepHooks``: the four
steps, backward, the optimizer step and gradient accumulation) that call it."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor, nn
from typing_extensions import override

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import ParallelRun
from lightning_mgpu.parallel.data import prepare_backward
from lightning_mgpu.parallel.tensor import tensor_parallel_context
from lightning_mgpu.strategy.setup import shard_gathered
from lightning_mgpu.strategy.weights import check_first_loss

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mgpu.backends import ZeroBackend
    from lightning_mgpu.parallel.pipeline import PipelineEngine
    from lightning_mgpu.planner.auto import StrategyPlan


class StepHooks(ParallelStrategy):
    """Mixed into ``HybridStrategy``, which sets the run (``parallel.ParallelRun``: the step runner, the pipeline
    engine, context parallelism), the data-parallel engine and the planner's plan."""

    _run: ParallelRun | None
    _data_parallel: ZeroBackend
    _plan: StrategyPlan | None
    _first_loss_checked: bool | None  # None: nothing to check; False: check the next training step's loss
    options: ParallelOptions

    if TYPE_CHECKING:

        @property
        def layout(self) -> ParallelLayout: ...

    @property
    def _data_parallel_roots(self) -> list[nn.Module]:
        """The modules data parallelism wrapped: the step runner, or this rank's pipeline stages (none outside a
        run)."""
        return self._run.roots if self._run is not None else []

    def _step(self, method_name: str, *args: object, **kwargs: object) -> Any:
        assert self._run is not None, "a step runs inside a run, after `setup`"
        context = self._tensor_parallel_context(method_name)
        return run_step(self.model, self._run, self.lightning_module, context, method_name, args, kwargs)

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
        assert self.lightning_module is not None and self._run is not None

        def lightnings_backward() -> Tensor:
            with self._tensor_parallel_context():
                return super(StepHooks, self).backward(closure_loss, optimizer, *args, **kwargs)

        return self._run.backward(closure_loss, self.lightning_module, self.precision_plugin, lightnings_backward)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:  # `manual_backward` runs inside the root's forward
            prepare_backward(self._data_parallel_roots, closure_loss)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], object], model: Any = None, **kwargs: object) -> Any:
        assert self.lightning_module is not None
        lightnings_step = partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        return self._data_parallel.optimizer_step(optimizer, closure, self.lightning_module, lightnings_step)

    def _tensor_parallel_context(self, method_name: str = "training_step") -> AbstractContextManager:
        return step_context(self.layout, self.options, method_name)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the non-final micro-steps of ``accumulate_grad_batches``."""
        run = self._run
        assert run is not None
        run.set_gradient_sync(False)
        try:
            yield
        finally:
            run.set_gradient_sync(True)


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
    run: ParallelRun,
    module: Any,  # the strategy's lightning_module: typed Optional by Lightning, set by now
    context: AbstractContextManager,
    method_name: str,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """``method_name`` of the user's ``module`` (a LightningModule) on this rank's part of the batch (with context
    parallelism: its part of each sequence), through ``model`` (what Lightning holds: the run's step runner, or the
    engine wrapped around it) or the run's pipeline schedule."""
    if run.context is None:
        return _call_step(model, run.pipeline, module, context, method_name, args, kwargs)
    args = run.context.split(method_name, args)
    output = _call_step(model, run.pipeline, module, context, method_name, args, kwargs)
    return run.context.finish(method_name, output)


def _call_step(
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
