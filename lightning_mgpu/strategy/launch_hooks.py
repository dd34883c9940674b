"""``HybridStrategy``'s start and end of a run as its launcher sees them: the processes started (the launchers),
the process group and the first collectives under the start-up bound, the layout agreed and the mesh built, the
heartbeat, a rank's failure reported, and the signals torchrun and SLURM send every rank."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.seed import reset_seed
from typing_extensions import override

from lightning_mgpu._compat.c10d import default_store
from lightning_mgpu._compat.lightning import (
    IS_INTERACTIVE,
    DeferredRequeue,
    StrategyHooks,
    default_process_group_backend,
    defer_slurm_requeue,
    init_dist_connection,
    quiet_sigterm_notifier,
    set_device_mesh,
)
from lightning_mgpu.launch import (
    Heartbeat,
    HybridMultiProcessingLauncher,
    HybridSubprocessScriptLauncher,
    StartupBound,
    coordinates,
    describe_rank,
    every_rank_failed,
    handle_rank_failure,
    refuse_shared_store_restarts,
    startup,
)
from lightning_mgpu.layout import DP_AXIS, ModuleMesh, gradient_mesh
from lightning_mgpu.options import StartMethod
from lightning_mgpu.patches import PatchLog
from lightning_mgpu.strategy.layout_choice import agreed_plan
from lightning_mgpu.strategy.layout_hooks import LayoutHooks

if TYPE_CHECKING:
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from torch.distributed import ProcessGroup

    from lightning_mgpu.planner.auto import StrategyPlan


class LaunchHooks(StrategyHooks, LayoutHooks):
    """Mixed into ``HybridStrategy``, which sets these attributes in ``__init__``; the layout's own hooks below it."""

    _start_method: StartMethod
    _timeout: timedelta | None
    _plan: StrategyPlan | None
    _dp_group: ProcessGroup
    _reduce_group: ProcessGroup
    _heartbeat: Heartbeat | None
    _startup: StartupBound | None
    _requeue: DeferredRequeue | None
    _patches: PatchLog
    _failed: bool
    _interrupted: bool

    if TYPE_CHECKING:

        def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    @override
    def configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        start_method = self._start_method
        if start_method == "auto":
            start_method = "fork" if IS_INTERACTIVE else "popen"
        if start_method == "popen":
            self._launcher = HybridSubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, self, self._timeout
            )
        else:
            self._launcher = HybridMultiProcessingLauncher(self, start_method=start_method)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Which rank failed and why, for the one report (launch/failures.py) the launcher's main process prints.
        mesh_shape = self._layout.mesh_shape if self._layout is not None else (1, self.world_size, 1)
        report = getattr(self._launcher, "report_failure", None)
        self._failed = self._interrupted = True  # teardown then runs no collective (the module is not gathered back)
        handle_rank_failure(exception, self.global_rank, self.world_size, mesh_shape, report)
        # ... unless every rank failed in this run: none is left in a collective, the module comes back plain.
        self._failed = not every_rank_failed(exception, self.world_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = self._process_group_backend or default_process_group_backend(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        refuse_shared_store_restarts()
        self._startup = self._start_bound()
        with startup.phase(self._startup, startup.PROCESS_GROUP, then=startup.FIRST_COLLECTIVES):
            init_dist_connection(
                self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
            )
        with startup.phase(self._startup, startup.FIRST_COLLECTIVES, then=startup.USER_HOOKS):
            self._first_collectives()

    def _first_collectives(self) -> None:
        """The layout agreed, the mesh and its groups built, the heartbeat started: the first use of the group."""
        if self._layout is None:  # several layouts possible: the planner chooses, with the module at hand
            devices = (self.world_size, self.num_processes, self.root_device.type)
            precision = str(self.precision_plugin.precision)
            args = (self._layout_choices, self.options, precision, devices, self.global_rank, self.broadcast)
            self._plan = agreed_plan(self.lightning_module, *args)
            self._layout = self._plan.layout
            self._check_layout(self._layout)
        self._device_mesh = self.layout.build_mesh(self.root_device.type)
        self._dp_group = self._device_mesh[DP_AXIS].get_group()  # looked up once: slicing a mesh is not free
        # Logged values average over every rank that computed part of them: dp, and cp's sequence shards.
        self._reduce_group = gradient_mesh(self._device_mesh).get_group()
        beat = self._launch_options.heartbeat_timeout
        if beat is not None and self.world_size > 1:
            shape = self.layout.mesh_shape
            describe = functools.partial(coordinates, mesh_shape=shape)
            self._heartbeat = Heartbeat(default_store(), self.global_rank, self.world_size, beat, describe).start()
        # A user's `configure_model` may read `self.device_mesh`, by its names or Lightning's ModelParallelStrategy's.
        if self.lightning_module is not None:
            set_device_mesh(self.lightning_module, ModuleMesh(self._device_mesh))

    def _start_bound(self) -> StartupBound | None:
        """This run's bound on its start (``init_timeout``), named by the layout's coordinates once they are known."""
        seconds = self._launch_options.init_timeout
        if seconds is None or self.world_size == 1:
            return None
        assert self.cluster_environment is not None
        external = self.cluster_environment.creates_processes_externally  # torchrun/SLURM stop ranks by SIGTERM
        describe = describe_rank(self)
        return StartupBound(seconds, self.global_rank, self.world_size, describe, listen_for_sigterm=external).start()

    def _end_startup(self) -> None:
        if self._startup is not None:
            self._startup.stop()
            self._startup = None

    def _watch_signals(self, trainer: pl.Trainer) -> None:
        """Under torchrun/SLURM, which signal every rank: Lightning's SIGTERM notifier without its broadcast, and
        SLURM's requeue run by every rank at the same step (both undone at teardown)."""
        assert self.cluster_environment is not None
        if self.world_size == 1 or not self.cluster_environment.creates_processes_externally:
            return
        undo = quiet_sigterm_notifier(trainer)
        if undo is not None:
            self._patches.add(undo)
        self._requeue = defer_slurm_requeue(trainer, default_store())
        if self._requeue is not None:
            self._patches.add(self._requeue.undo)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._requeue is not None:  # SLURM's requeue signal, acted on by every rank at the same step
            assert self.lightning_module is not None
            self._requeue.at_step_start(self.lightning_module.trainer.global_step)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._end_startup()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._end_startup()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._end_startup()
