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

This module runs a step; its parts live beside it: capture and replay of the user's step (``pipeline_capture``),
building and caching torch's schedules (``pipeline_schedules``), publishing logs and metrics (``pipeline_publish``),
the split itself (``pipeline``). Nothing here reads a device value back per microbatch: microbatches are counted
on the host, losses and logged values stay on the device until the step's one broadcast.

Contract: one network call per step, before which the step does nothing with side effects beyond ``self.log``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_mgpu._compat.tensors import tree_map
from lightning_mgpu.parallel.data import once_per_step
from lightning_mgpu.parallel.pipeline.capture import StepCapture
from lightning_mgpu.parallel.pipeline.microbatches import (
    MicrobatchPlan,
    batch_size_of,
    plan_microbatches,
    split_microbatches,
)
from lightning_mgpu.parallel.pipeline.plan import V_SCHEDULES, stage_owner
from lightning_mgpu.parallel.pipeline.publish import MetricRelay, Publisher, StepLogs
from lightning_mgpu.parallel.pipeline.schedules import ScheduleCache
from lightning_mgpu.parallel.pipeline.split import PipelineRuntime

if TYPE_CHECKING:
    from torch.amp import GradScaler
    from torch.distributed import ProcessGroup

_Tree = TypeVar("_Tree")


class PipelinePrecision(Protocol):
    """What ``share_with`` reads and sets on the precision plugin (``HybridPrecision``)."""

    grad_norm_group: ProcessGroup | None
    grads_counted_elsewhere: Callable[[], AbstractSet[int]]

    @property
    def scaler(self) -> GradScaler | None: ...


class _TrainingStep:
    """What the schedule's loss function needs during one training step: the step's inputs and where it stands."""

    def __init__(self, microbatches: list[object], batch_idx: int, loss_scale: float) -> None:
        self.microbatches = microbatches
        self.batch_idx = batch_idx
        self.loss_scale = loss_scale
        self.logs = StepLogs()
        self.next_microbatch = 0  # the loss runs once per microbatch, in order, on the last stage


class PipelineEngine:
    """One rank of a pipeline: runs Lightning's training and evaluation steps through the torch schedule."""

    def __init__(
        self,
        module: nn.Module,
        runtime: PipelineRuntime,
        schedule_name: str,
        num_microbatches: int | None,
        pp_group: ProcessGroup,
        device: torch.device,
    ) -> None:
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
        self.gradients_pending = False
        # False on the non-final micro-steps of gradient accumulation (the strategy's `block_backward_sync`).
        self.sync_gradients = True
        # The precision plugin's job-wide loss scaler (16-mixed): applied to each microbatch's loss here, since
        # the schedule runs backward itself. `share_with` sets it.
        self.grad_scaler: GradScaler | None = None
        self._replanned: set[tuple[int, int]] = set()
        self._training: _TrainingStep | None = None  # set while a training step's schedule runs
        self._forward_only = False  # multi-stage schedules call the loss function even when run forward-only
        self._guarded: list[tuple[Any, Any | None]] = []  # (optimizer, its instance zero_grad before the guard)
        path = [module]
        for part in runtime.split.container_fqn.split(".")[:-1]:
            path.append(path[-1].get_submodule(part))
        self.capture = StepCapture(module, path)
        self.relay = MetricRelay(module)
        self.publisher = Publisher(pp_group, self.last_stage_rank, device)
        self.schedules = ScheduleCache(runtime, pp_group, device, self._loss)

    # --------------------------------------------------------------------------------------------------- steps
    def training_step(self, batch: object, batch_idx: int, *, accumulate_grad_batches: int) -> torch.Tensor:
        """Forward *and* backward of the step (the schedule interleaves them); Lightning's backward is skipped."""
        if batch_idx % accumulate_grad_batches == 0:
            self._clear_gradients()
        # Lightning zeroes gradients after `training_step` returns, expecting backward to follow: skip that once.
        self.gradients_pending = True
        microbatches, plan = self._split(batch)
        self._start(microbatches, "training_step", batch_idx)
        step = self._training = _TrainingStep(microbatches, batch_idx, 1.0 / (plan.count * accumulate_grad_batches))
        if self.owns_last:
            self.relay.begin()
        losses: list = []
        schedule = self.schedules.get(plan, microbatches[0], training=True)
        try:
            with once_per_step(self.runtime.stages):
                schedule.step(
                    *self._stage_inputs(plan.count), **self._targets(plan.count), losses=losses, return_outputs=False
                )
        finally:
            self._training = None
        if self.sync_gradients and self.runtime.tied_gradients:
            self.runtime.tied_gradients.sum_gradients(self.module)
        loss = None
        if losses:
            with torch.no_grad():
                loss = torch.stack(losses).mean() / step.loss_scale
                if self.grad_scaler is not None:
                    loss = loss / self.grad_scaler.get_scale()
        return self.publisher.publish(self.module, self.relay, loss, step.logs, objects=False)

    def evaluation_step(self, method: str, batch: object, *args: object) -> Any:
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
        schedule = self.schedules.get(plan, microbatches[0], training=not single)
        self._forward_only = True
        try:
            if v_shaped:
                with torch.inference_mode(False), torch.enable_grad():
                    schedule.step(*self._stage_inputs(count), **self._targets(count), return_outputs=False)
            else:
                targets = {} if single else self._targets(count)
                schedule.eval(*self._stage_inputs(count), **targets, return_outputs=False)
        finally:
            self._forward_only = False
        logs = StepLogs()
        results = None
        if self.owns_last:
            self.relay.begin()
            with torch.no_grad():
                results = _merge([self._replay(method, (mb, *args), k, logs) for k, mb in enumerate(microbatches)])
        return self.publisher.publish(self.module, self.relay, results, logs, objects=True)

    def _clear_gradients(self) -> None:
        """At an accumulation window's start, what Lightning's ``zero_grad`` clears (it runs after the step here,
        so ``guard_zero_grad`` skips it): the optimizers' parameters, read from their groups every time (a callback
        may add a group). Those are the tensors the optimizer steps, FSDP2's sharded ones included, whichever
        Parameters the module has registered at the moment (walking the module costs ~5x more). Without an
        optimizer (``configure_optimizers`` returned none), the module's parameters."""
        groups = [group for optimizer, _ in self._guarded for group in optimizer.param_groups]
        params = [param for group in groups for param in group["params"]] or self.module.parameters()
        for param in params:
            param.grad = None

    def _split(self, batch: object) -> tuple[list[object], MicrobatchPlan]:
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

    def _start(self, microbatches: list[object], method: str, *args: object) -> None:
        step = getattr(self.module, method)
        self.runtime.start_step(self.capture.capture_all([functools.partial(step, mb, *args) for mb in microbatches]))
        if self.runtime.carried.keys is None:  # the first step: what the first stage sends besides the activation
            devices = [self.device] if self.device.type != "cpu" else []
            with torch.random.fork_rng(devices=devices, device_type=self.device.type):
                self.runtime.agree_carried(self.group)

    def _stage_inputs(self, count: int) -> tuple:
        # A placeholder the schedule splits into one row per microbatch; stage 0 counts its microbatches itself.
        return (torch.zeros(count, 1, device=self.device),) if self.owns_first else ()

    def _targets(self, count: int) -> dict:
        return {"target": torch.zeros(count, device=self.device)} if self.owns_last else {}

    def _replay(self, method: str, args: tuple, microbatch: int, logs: StepLogs) -> object:
        call = self.runtime.calls[microbatch]
        step = lambda: getattr(self.module, method)(*args)
        if self.runtime.inferring:
            # torch's shape-inference trial: neither its logs nor its metric updates are real.
            with self.relay.frozen():
                return self.capture.replay(call, self.runtime.trial_output, step, StepLogs())
        return self.capture.replay(call, self.runtime.outputs.pop(microbatch), step, logs)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the user's own step, replayed with this microbatch's output."""
        if self._forward_only:
            return output.sum() * 0.0
        step = self._training
        assert step is not None
        microbatch = 0 if self.runtime.inferring else step.next_microbatch
        if not self.runtime.inferring:
            step.next_microbatch += 1
        result = self._replay("training_step", (step.microbatches[microbatch], step.batch_idx), microbatch, step.logs)
        loss = result["loss"] if isinstance(result, dict) else result
        if not torch.is_tensor(loss):
            raise RuntimeError("training_step must return the loss (a tensor or a dict with 'loss') under pipelining.")
        loss = loss * step.loss_scale
        return self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss

    # ------------------------------------------------------------------------------------ the strategy's side
    def share_with(self, precision_plugin: PipelinePrecision) -> None:
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
        """Keep Lightning's post-``training_step`` ``zero_grad`` from erasing the gradients the schedule made.

        Undone by ``remove()``.
        """
        self._guarded.append((optimizer, vars(optimizer).get("zero_grad")))
        zero_grad = optimizer.zero_grad

        def guarded(*args: object, **kwargs: object) -> None:
            if self.gradients_pending:
                self.gradients_pending = False
                return
            zero_grad(*args, **kwargs)

        optimizer.zero_grad = guarded

    def remove(self) -> None:
        """Take our hooks and optimizer guards off the user's objects (idempotent).

        The split itself is undone by ``runtime.unsplit`` (HybridStrategy's ``ModuleSnapshot`` restores the whole
        module tree after gathering the trained values, which the stand-ins' originals lack).
        """
        self.relay.remove()
        self.publisher.forget_logs()
        for optimizer, zero_grad in reversed(self._guarded):
            if zero_grad is None:
                vars(optimizer).pop("zero_grad", None)
            else:
                optimizer.zero_grad = zero_grad
        self._guarded = []


def _merge(results: list) -> object:
    if all(r is None for r in results):
        return None
    if all(torch.is_tensor(r) for r in results):
        if all(r.dim() == 0 for r in results):
            return torch.stack([r.detach() for r in results]).mean()
        return torch.cat([r.detach() for r in results])
    return results


def _outside_inference_mode(tree: _Tree) -> _Tree:
    """Normal (autograd-capable) copies of tensors made under Lightning's evaluation ``inference_mode``."""
    with torch.inference_mode(False):
        return tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, tree)
