"""``ScalingMonitor``: where each training step's time goes, throughput, MFU and memory per rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu._compat.lightning import fit_data_fetcher
from lightning_mgpu.layout import PP_AXIS, TP_AXIS, ParallelLayout
from lightning_mgpu.monitor import measures
from lightning_mgpu.monitor import report as reporting
from lightning_mgpu.monitor.timing import (
    FORWARD_BACKWARD,
    OPTIMIZER,
    Clock,
    CollectiveTimer,
    DataFetchTimer,
    StepRecorder,
    mesh_axes,
)
from lightning_mgpu.parallel.experts import ExpertTokenCounts

FlopsPerStep = float | Callable[[Any], float]


class ScalingMonitor(Callback):
    """Split every ``every_n_steps``-th training step into compute, communication per mesh axis, pipeline bubble,
    data-loader wait, optimizer step and the rest; log throughput, MFU and memory per rank; at the end of ``fit``
    print a table and write ``scaling_report.json`` and ``scaling_report.png`` (global rank 0).

    Works with any strategy; with ``HybridStrategy`` communication is named by mesh axis (``tp``, ``pp``, ``dp``)
    and the pipeline's bubble is compared with its schedule's theory.

    Args:
        every_n_steps: measure one step in this many (the others run untouched but for one attribute check).
        warmup_steps: steps not measured at the start of fit (the first compiles schedules, warms caches).
        peak_flops: FLOP/s of one device for MFU; default: a data-sheet table for GPUs, a measured matmul on CPU.
        flops_per_step: model FLOPs of one step of the whole job, a number or ``f(batch) -> float`` (the batch of
            one rank); default ``6 x parameters x tokens`` (dense transformer training).
        dirpath: where the report goes; default the Trainer's ``log_dir`` (or ``default_root_dir``).
        filename: stem of the two files.
        measure_activations: count the bytes saved for backward on the first measured step.
        verbose: print the table at the end of fit.
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        warmup_steps: int = 1,
        peak_flops: float | None = None,
        flops_per_step: FlopsPerStep | None = None,
        dirpath: str | Path | None = None,
        filename: str = "scaling_report",
        measure_activations: bool = True,
        verbose: bool = True,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be a positive integer, got {every_n_steps!r}.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be a non-negative integer, got {warmup_steps!r}.")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"`peak_flops` must be a positive number of FLOP/s per device, got {peak_flops!r}.")
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.peak_flops = peak_flops
        self.flops_per_step = flops_per_step
        self.dirpath = dirpath
        self.filename = filename
        self.measure_activations = measure_activations
        self.verbose = verbose
        self.report: dict[str, Any] | None = None  # the last report, on global rank 0
        self._reset()

    def _reset(self) -> None:
        self._clock: Clock | None = None
        self._recorder: StepRecorder | None = None
        self._collectives: CollectiveTimer | None = None
        self._data: DataFetchTimer | None = None
        self._activations: measures.SavedActivations | None = None
        self._seen = 0
        self._batch_stats = (0, 0)
        self._steps: list[dict[str, object]] = []  # sent to global rank 0 as they are
        self._memory: dict[str, int] = {"activations": 0}
        self._flops: float | None = None
        self._expert_tokens: ExpertTokenCounts | None = None

    # --------------------------------------------------------------------------------------------- start / end
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self._clock = Clock(pl_module.device)
        self._recorder = StepRecorder(self._clock)
        self._data = DataFetchTimer(self._recorder)
        if _distributed():
            axes = mesh_axes(_device_mesh(trainer.strategy))
            # Without a mesh the world is the data-parallel group (DDP); with one, collectives over every rank are
            # synchronization points (Lightning's per-step stop-signal broadcast) that wait for the slowest rank.
            self._collectives = CollectiveTimer(self._recorder, axes, world_axis="sync" if axes else "dp")
            self._collectives.install()
        self._expert_tokens = ExpertTokenCounts(pl_module)  # per-expert token counts, if the model has experts
        if not self._expert_tokens.counts:
            self._expert_tokens = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()
        payload = self._payload(trainer, pl_module)
        ranks = [payload]
        if _distributed() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(ranks, payload)
        # `trainer.log_dir` broadcasts from rank 0: every rank asks for it.
        directory = Path(self.dirpath or trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        if not self._steps:
            rank_zero_warn(
                f"ScalingMonitor measured no step: fit ran {self._seen} steps and the monitor skips the first"
                f" warmup_steps={self.warmup_steps} and the first step of each epoch. Run more steps, or lower"
                " `warmup_steps`."
            )
        context = self._context(trainer, pl_module)
        self.report = reporting.build_report(context, ranks)
        directory.mkdir(parents=True, exist_ok=True)
        reporting.write_json(self.report, directory / f"{self.filename}.json")
        reporting.write_plot(self.report, directory / f"{self.filename}.png")
        if self.verbose:
            print(reporting.format_table(self.report))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    def _remove(self) -> None:
        """Undo every patch: collectives, the data fetcher, the saved-tensor hooks."""
        if self._recorder is not None:
            self._recorder.active = False
        if self._collectives is not None:
            self._collectives.remove()
            self._collectives = None
        if self._data is not None:
            self._data.remove()
        if self._expert_tokens is not None:
            self._expert_tokens.remove()
        self._close_activations()

    # ---------------------------------------------------------------------------------------------------- steps
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause()  # the gap between epochs (validation, checkpoints) is no step

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause()  # a step whose interval holds a validation run is not measured

    def _pause(self) -> None:
        if self._recorder is not None:
            self._recorder.active = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None or not recorder.active:
            return
        recorder.enter(FORWARD_BACKWARD)
        self._batch_stats = measures.batch_size_and_tokens(batch)
        if callable(self.flops_per_step) and self._flops is None:
            self._flops = float(self.flops_per_step(batch))
        if self.measure_activations and not self._steps:
            self._activations = measures.SavedActivations(pl_module).__enter__()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        recorder = self._recorder
        if recorder is None or not recorder.active:
            return
        recorder.enter(OPTIMIZER)
        self._close_activations()
        if not self._steps:  # gradients exist only now: count them once
            self._memory.update(measures.model_bytes(pl_module, []))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None:
            return
        end = self._clock.mark()  # type: ignore[union-attr]
        if recorder.active:
            self._close_activations()
            step = recorder.finish(end)
            samples, tokens = self._batch_stats
            self._steps.append({"step": batch_idx, "samples": samples, "tokens": tokens, **step})
            self._log(trainer, step, samples, tokens)
        self._seen += 1
        if self._seen >= self.warmup_steps and (self._seen - self.warmup_steps) % self.every_n_steps == 0:
            assert self._data is not None  # made with the recorder, in on_train_start
            self._data.install(fit_data_fetcher(trainer))
            if self._collectives is not None:
                self._collectives.forget()
            recorder.begin(end)

    def _close_activations(self) -> None:
        if self._activations is not None:
            self._activations.__exit__(None, None, None)
            self._memory["activations"] = max(self._memory["activations"], self._activations.bytes)
            self._activations = None

    def _log(self, trainer: pl.Trainer, step: dict[str, Any], samples: int, tokens: int) -> None:
        """Global rank 0's view of the step, through the Trainer's loggers (no communication)."""
        if not trainer.is_global_zero or not trainer.loggers or step["wall_s"] <= 0:
            return
        wall = step["wall_s"]
        replicas = _replicas(trainer)
        metrics = {
            "scaling/step_s": wall,
            "scaling/samples_per_s": samples * replicas / wall,
            "scaling/tokens_per_s": tokens * replicas / wall,
        }
        metrics.update({f"scaling/share_{name}": seconds / wall for name, seconds in step["parts_s"].items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------------------------------- end of fit
    def _payload(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        device = pl_module.device
        local = getattr(trainer.strategy, "num_processes", 1) or 1
        memory: dict[str, object] = {**self._memory, **measures.model_bytes(pl_module, list(trainer.optimizers))}
        memory["gradients"] = self._memory.get("gradients", memory["gradients"])
        memory.update(measures.peak_and_capacity(device, local))
        mesh = _device_mesh(trainer.strategy)
        pp_rank = mesh[PP_AXIS].get_local_rank() if mesh is not None and PP_AXIS in (mesh.mesh_dim_names or ()) else 0
        return {
            "rank": trainer.global_rank,
            "pp_rank": pp_rank,
            "params_held": measures.parameters_held(pl_module),
            "expert_tokens": _expert_tokens(self._expert_tokens, mesh),
            "steps": self._steps,
            "memory": memory,
        }

    def _context(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        strategy = trainer.strategy
        device = pl_module.device
        peak, source = (
            (self.peak_flops, "given")
            if self.peak_flops
            else measures.device_peak_flops(device, str(trainer.precision))
        )
        flops = self._flops if callable(self.flops_per_step) else self.flops_per_step
        layout = _layout(strategy)
        options = getattr(strategy, "options", None)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return {
            "strategy": type(strategy).__name__,
            "layout": None
            if layout is None
            else {
                "data_parallel_size": layout.data_parallel_size,
                "tensor_parallel_size": layout.tensor_parallel_size,
                "pipeline_parallel_size": layout.pipeline_parallel_size,
                "zero_stage": layout.zero_stage,
                "context_parallel_size": layout.context_parallel_size,
            },
            "options": {}
            if options is None
            else {
                k: str(getattr(options, k))
                if not isinstance(getattr(options, k), (bool, int, type(None)))
                else getattr(options, k)
                for k in ("activation_checkpointing", "pipeline_schedule", "num_microbatches", "sequence_parallel")
            },
            "world_size": trainer.world_size,
            "data_parallel_replicas": _replicas(trainer),
            "device": name,
            "precision": str(trainer.precision),
            "every_n_steps": self.every_n_steps,
            "peak_flops_per_device": peak,
            "peak_source": source,
            "flops_per_step": flops,
            "pipeline": _pipeline_info(strategy),
        }


def _expert_tokens(counter: ExpertTokenCounts | None, mesh: DeviceMesh | None) -> dict[str, list[int]]:
    """This rank's per-expert token counts per MoE layer; empty on tensor-parallel peers (they see the same tokens)."""
    tp_peer = mesh is not None and TP_AXIS in (mesh.mesh_dim_names or ()) and mesh[TP_AXIS].get_local_rank() > 0
    if counter is None or tp_peer:
        return {}
    return {name: counts.tolist() for name, counts in counter.counts.items()}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _layout(strategy: Strategy) -> ParallelLayout | None:
    try:
        return getattr(strategy, "layout", None)
    except RuntimeError:  # HybridStrategy whose planner has not chosen yet
        return None


def _device_mesh(strategy: Strategy) -> DeviceMesh | None:
    try:
        return getattr(strategy, "device_mesh", None)
    except RuntimeError:  # HybridStrategy before its processes start
        return None


def _replicas(trainer: pl.Trainer) -> int:
    """Ranks that read distinct samples: what the strategy shards the data over."""
    try:
        return int(trainer.strategy.distributed_sampler_kwargs["num_replicas"])  # type: ignore[attr-defined]
    except Exception:
        return 1


def _pipeline_info(strategy: Strategy) -> reporting.PipelineInfo | None:
    engine = getattr(strategy, "pipeline", None)
    if engine is None:
        return None
    stages = engine.runtime.num_stages
    return {
        "schedule": engine.schedule_name,
        "pp": engine.pp_size,
        "stages": stages,
        "num_microbatches": engine.num_microbatches or stages,
    }
