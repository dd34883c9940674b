"""Run a LightningModule's steps through a pipeline schedule, leaving the user's step code as it is.

A step is run in three parts:

1. *capture*, on every rank, per microbatch: the user's step runs until it calls the network (``self(x)`` or a
   submodule such as ``self.model(input_ids=x)``); the call's arguments are recorded and the step is cut short;
2. the torch schedule runs the stages, feeding stage 0 the microbatch index;
3. *replay*, on the rank holding the last stage, per microbatch (inside the schedule's loss function during
   training): the user's step runs again and its network call returns that microbatch's pipeline output, so the
   loss and every logged value are computed by the user's own code.

Logged values (mean over microbatches), torchmetrics objects and the returned loss are then sent from the last
stage to the pipeline group and logged on every rank (``pipeline_publish``), so loggers, the progress bar and
callbacks on global rank 0 (which holds the first stage) see what a single-process run shows.

Contract: one network call per step, before which the step does nothing with side effects beyond ``self.log``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_mgpu.parallel.microbatches import (
    MicrobatchPlan,
    batch_size_of,
    plan_microbatches,
    split_microbatches,
    tensor_leaves,
)
from lightning_mgpu.parallel.pipeline import V_SCHEDULES, NetworkCall, PipelineRuntime, stage_owner
from lightning_mgpu.parallel.pipeline_publish import MetricRelay, Publisher, StepLogs


class _Captured(Exception):
    def __init__(self, call: NetworkCall) -> None:
        super().__init__()
        self.call = call


class PipelineEngine:
    """The schedules, capture hooks and broadcast logic for one rank of a pipeline."""

    def __init__(
        self,
        module: nn.Module,
        runtime: PipelineRuntime,
        schedule_name: str,
        num_microbatches: Optional[int],
        pp_group: Any,
        device: torch.device,
    ) -> None:
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(
                "pipeline_parallel_size > 1 runs forward and backward inside the pipeline schedule, so it needs"
                " automatic optimization; this module sets `automatic_optimization = False`. Use"
                " pipeline_parallel_size=1 (tensor/data parallelism and ZeRO support manual optimization)."
            )
        self.module = module
        self.runtime = runtime
        self.schedule_name = schedule_name
        self.num_microbatches = num_microbatches
        self.group = pp_group
        self.device = device
        self.ranks = dist.get_process_group_ranks(pp_group)
        self.pp_size = len(self.ranks)
        last = stage_owner(schedule_name, runtime.num_stages - 1, self.pp_size, runtime.num_stages // self.pp_size)
        self.last_stage_rank = self.ranks[last]
        self.owns_first = any(s.is_first for s in runtime.stages)
        self.owns_last = any(s.is_last for s in runtime.stages)
        self._mode = "idle"
        self._zero_loss = False
        self.gradients_pending = False
        # False on the non-final micro-steps of gradient accumulation (the strategy's `block_backward_sync`).
        self.sync_gradients = True
        self._replay_calls = 0
        self._schedules: dict[Any, Any] = {}
        self._replanned: set[tuple[int, int]] = set()
        self._loss_scale = 1.0
        # The precision plugin's job-wide loss scaler (16-mixed): applied to each microbatch's loss here, since
        # the schedule runs backward itself. HybridStrategy sets it.
        self.grad_scaler: Optional[Any] = None
        self._current: Optional[dict[str, Any]] = None
        self.relay = MetricRelay(module)
        self.publisher = Publisher(pp_group, self.last_stage_rank, device)
        path = [module]
        for part in runtime.split.container_fqn.split(".")[:-1]:
            path.append(path[-1].get_submodule(part))
        self._hooks = [m.register_forward_pre_hook(self._on_network_call, with_kwargs=True) for m in path]

    # ---------------------------------------------------------------------------------------- capture / replay
    def _on_network_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._mode == "capture":
            raise _Captured(NetworkCall(module, args, kwargs))
        if self._mode == "replay":
            self._replay_calls += 1
            if self._replay_calls > 1:
                raise RuntimeError(
                    "With pipeline_parallel_size > 1 a step may call the network once (it runs split across"
                    f" ranks); {type(module).__name__} was called again. Compute everything from one call's output."
                )
        return None

    def _capture(self, step: Callable[[], Any]) -> NetworkCall:
        self._mode = "capture"
        try:
            with _muted_logging(self.module, None):
                step()
        except _Captured as captured:
            return captured.call
        finally:
            self._mode = "idle"
        raise RuntimeError(
            "With pipeline_parallel_size > 1 the step must call the network (`self(x)` or the submodule holding the"
            " blocks, e.g. `self.model(...)`), but it returned without doing so."
        )

    def _replay(self, method: str, args: tuple, microbatch: int, logs: StepLogs) -> Any:
        if self.runtime.inferring:
            # torch's shape-inference trial: neither its logs nor its metric updates are real.
            with self.relay.frozen():
                return self._replay_with(self.runtime.trial_output, method, args, microbatch, StepLogs())
        return self._replay_with(self.runtime.outputs.pop(microbatch), method, args, microbatch, logs)

    def _replay_with(self, output: Any, method: str, args: tuple, microbatch: int, logs: StepLogs) -> Any:
        call = self.runtime.calls[microbatch]
        had_instance_forward = "forward" in vars(call.module)
        original = call.module.forward
        call.module.forward = lambda *a, **k: output  # type: ignore[method-assign]
        self._mode, self._replay_calls = "replay", 0
        try:
            with _muted_logging(self.module, logs):
                return getattr(self.module, method)(*args)
        finally:
            self._mode = "idle"
            if had_instance_forward:
                call.module.forward = original  # type: ignore[method-assign]
            else:
                del call.module.forward

    # --------------------------------------------------------------------------------------------------- steps
    def training_step(self, batch: Any, batch_idx: int, accumulate_grad_batches: int) -> torch.Tensor:
        """Forward *and* backward of the step (the schedule interleaves them); Lightning's backward is skipped."""
        if batch_idx % accumulate_grad_batches == 0:
            for param in self.module.parameters():
                param.grad = None
        # Lightning zeroes gradients after `training_step` returns, expecting backward to follow: skip that once.
        self.gradients_pending = True
        microbatches, plan = self._split(batch)
        count = plan.count
        self._start(microbatches, "training_step", batch_idx)
        logs = StepLogs()
        if self.owns_last:
            self.relay.begin()
        self._current = {"microbatches": microbatches, "batch_idx": batch_idx, "logs": logs}
        self._loss_scale = 1.0 / (count * accumulate_grad_batches)
        losses: list = []
        schedule = self._schedule(plan, microbatches, training=True)
        schedule.step(*self._stage_inputs(count), **self._targets(count), losses=losses, return_outputs=False)
        if self.sync_gradients and self.runtime.tied_gradients:
            self.runtime.tied_gradients.sum_gradients(self.module)
        loss = torch.stack([l.detach() for l in losses]).mean() / self._loss_scale if losses else None
        if loss is not None and self.grad_scaler is not None:
            loss = loss / self.grad_scaler.get_scale()
        return self._publish(loss, logs, objects=False)

    def evaluation_step(self, method: str, batch: Any, *args: Any) -> Any:
        """Forward-only through the pipeline, then the user's step on the last stage with each microbatch's output."""
        microbatches, plan = self._split(batch)
        count = plan.count
        single = len(self.runtime.stages) == 1
        # torch 2.13's V schedules (stage 0 and the last stage on one rank) cannot run forward-only ("can't
        # steal_bwd_input if this stage doesn't have backward"): they run a training step with a zero loss, whose
        # zero gradients change nothing. Every other schedule runs forward only.
        v_shaped = self.schedule_name in V_SCHEDULES
        if v_shaped:
            microbatches = _outside_inference_mode(microbatches)
        self._start(microbatches, method, *args)
        schedule = self._schedule(plan, microbatches, training=not single)
        self._zero_loss = True  # multi-stage schedules call their loss function even forward-only
        try:
            if v_shaped:
                with torch.inference_mode(False), torch.enable_grad():
                    schedule.step(*self._stage_inputs(count), **self._targets(count), return_outputs=False)
            else:
                targets = {} if single else self._targets(count)
                schedule.eval(*self._stage_inputs(count), **targets, return_outputs=False)
        finally:
            self._zero_loss = False
        logs = StepLogs()
        results = None
        if self.owns_last:
            self.relay.begin()
            with torch.no_grad():
                results = _merge([self._replay(method, (mb, *args), k, logs) for k, mb in enumerate(microbatches)])
        return self._publish(results, logs, objects=True)

    def _split(self, batch: Any) -> tuple[list[Any], MicrobatchPlan]:
        requested = self.num_microbatches or self.runtime.num_stages
        size = batch_size_of(batch)
        plan = plan_microbatches(self.schedule_name, requested, size, self.pp_size, self.runtime.num_stages)
        if plan != MicrobatchPlan(requested, self.schedule_name) and (size, requested) not in self._replanned:
            self._replanned.add((size, requested))
            rank_zero_warn(
                f"A batch of {size} samples (per data-parallel rank) does not split into num_microbatches={requested}"
                f" equal microbatches for {self.schedule_name}; such batches run as {plan.count} microbatches"
                f" with {plan.schedule}. The result is the same; only the pipeline's efficiency changes. A last batch"
                " of an epoch is often ragged: `DataLoader(drop_last=True)` avoids it."
            )
        return split_microbatches(batch, plan.count), plan

    def _start(self, microbatches: list[Any], method: str, *args: Any) -> None:
        step = getattr(self.module, method)
        calls = [self._capture(lambda mb=mb: step(mb, *args)) for mb in microbatches]
        self.runtime.start_step(calls)

    def _stage_inputs(self, count: int) -> tuple:
        return (torch.arange(count, device=self.device).unsqueeze(1),) if self.owns_first else ()

    def _targets(self, count: int) -> dict:
        return {"target": torch.arange(count, device=self.device)} if self.owns_last else {}

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the user's own step, replayed with this microbatch's output."""
        if self._zero_loss:
            return output.sum() * 0.0
        assert self._current is not None
        microbatch = int(target.reshape(-1)[0])
        result = self._replay(
            "training_step",
            (self._current["microbatches"][microbatch], self._current["batch_idx"]),
            microbatch,
            self._current["logs"],
        )
        loss = result["loss"] if isinstance(result, dict) else result
        if not torch.is_tensor(loss):
            raise RuntimeError("training_step must return the loss (a tensor or a dict with 'loss') under pipelining.")
        loss = loss * self._loss_scale
        return self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss

    def _schedule(self, plan: MicrobatchPlan, microbatches: list[Any], training: bool) -> Any:
        from torch.distributed.pipelining.schedules import _ScheduleForwardOnly, get_schedule_class

        count = plan.count
        shapes = tuple(tuple(t.shape) for t in tensor_leaves(microbatches[0]))
        key = (training, plan, shapes)
        if key not in self._schedules:
            stages = [
                _trial_aware_stage_class()(stage, stage.index, self.runtime.num_stages, self.device, group=self.group)
                for stage in self.runtime.stages
            ]
            if len(stages) == 1 and not training:
                schedule = _ScheduleForwardOnly(stages[0], count)
            else:
                schedule_class = get_schedule_class(plan.schedule)
                kwargs = {"loss_fn": self._loss, "scale_grads": False}
                schedule = schedule_class(stages[0] if len(stages) == 1 else stages, count, **kwargs)
            self._schedules[key] = schedule
        return self._schedules[key]

    # ------------------------------------------------------------------------------------------------ publish
    def _publish(self, result: Any, logs: StepLogs, objects: bool) -> Any:
        """Send the last stage's result, logs and metric changes to the pipeline group; log them on every rank."""
        sending = dist.get_rank() == self.last_stage_rank
        result, means, metric_logs, changes = self.publisher.send(
            result, logs if sending else None, self.relay if sending else None, objects
        )
        if not sending:
            self.relay.apply(changes, self.device)
        for name, (value, kwargs) in means.items():
            self.module.log(name, torch.tensor(value, device=self.device), **kwargs)
        for name, (metric_name, kwargs) in metric_logs.items():
            self.module.log(name, self.relay.metrics[metric_name], **kwargs)
        return result

    def share_with(self, precision_plugin: Any) -> None:
        """What the precision plugin needs of the pipeline, and the other way round."""
        # Stages hold disjoint parameters (tied copies aside): gradient norms add up over the pipeline group.
        precision_plugin.grad_norm_group = self.group
        precision_plugin.grads_counted_elsewhere = self.grads_counted_elsewhere
        # 16-mixed: the schedule runs backward, so it scales each microbatch's loss with the job's scaler.
        self.grad_scaler = precision_plugin.scaler

    def grads_counted_elsewhere(self) -> set[int]:
        """This rank's tied copies whose gradients another stage counts in norms (see ``pipeline_ties``)."""
        ties = self.runtime.tied_gradients
        return ties.counted_elsewhere(self.module) if ties else set()

    def guard_zero_grad(self, optimizer: Any) -> None:
        """Keep Lightning's post-``training_step`` ``zero_grad`` from erasing the gradients the schedule made."""
        zero_grad = optimizer.zero_grad

        def guarded(*args: Any, **kwargs: Any) -> None:
            if self.gradients_pending:
                self.gradients_pending = False
                return
            zero_grad(*args, **kwargs)

        optimizer.zero_grad = guarded

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.relay.remove()


def _trial_aware_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class TrialAwareStage(PipelineStage):
        """Tells our stage when torch runs its shape-inference trial, so the trial consumes no microbatch."""

        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with _trial(self.submod):
                return super()._forward_metadata_inference(*args, **kwargs)

        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with _trial(self.submod):
                return super()._backward_metadata_inference(*args, **kwargs)

    return TrialAwareStage


@contextmanager
def _trial(stage: Any) -> Generator[None, None, None]:
    stage.inferring = stage.runtime.inferring = True
    try:
        yield
    finally:
        stage.inferring = stage.runtime.inferring = False


@contextmanager
def _muted_logging(module: nn.Module, record: Optional[StepLogs]) -> Generator[None, None, None]:
    """Route ``self.log``/``self.log_dict`` into ``record`` (or nowhere) while a step is captured or replayed."""
    from torchmetrics import MetricCollection

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if record is not None:
            record.record(name, value, kwargs)

    def log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(dictionary, MetricCollection):  # as Lightning: its metrics, under their collection names
            dictionary = dict(dictionary.items(keep_base=False, copy_state=False))
        for name, value in dictionary.items():
            log(name, value, **kwargs)

    module.log, module.log_dict = log, log_dict  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def _merge(results: Optional[list]) -> Any:
    if results is None:
        return None
    if all(r is None for r in results):
        return None
    if all(torch.is_tensor(r) for r in results):
        if all(r.dim() == 0 for r in results):
            return torch.stack([r.detach() for r in results]).mean()
        return torch.cat([r.detach() for r in results])
    return results


def _outside_inference_mode(tree: Any) -> Any:
    """Normal (autograd-capable) copies of tensors made under Lightning's evaluation ``inference_mode``."""
    from torch.utils._pytree import tree_map

    with torch.inference_mode(False):
        return tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, tree)
