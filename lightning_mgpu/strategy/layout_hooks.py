"""``HybridStrategy``'s layout and mesh: the resolved sizes, where ranks sit, what Lightning asks of a parallel
strategy about them (devices, sampler, world ranks), and the layout's checks when the Trainer is built."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_mgpu._compat.lightning import layer_sync
from lightning_mgpu.layout import DP_AXIS, ParallelLayout, RequestedSizes
from lightning_mgpu.layout_checks import check_sizes
from lightning_mgpu.options import LaunchOptions, ParallelOptions
from lightning_mgpu.planner import auto as planner_auto
from lightning_mgpu.strategy.layout_choice import check_trainer_layout

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mgpu.parallel import ParallelRun
    from lightning_mgpu.parallel.context import ContextParallel
    from lightning_mgpu.parallel.pipeline import PipelineEngine
    from lightning_mgpu.precision import HybridPrecision


class LayoutHooks(ParallelStrategy):
    """Mixed into ``HybridStrategy``, which sets the requested sizes and options in ``__init__``, the mesh in
    ``setup_environment`` and the run (its pipeline engine and context parallelism) in ``setup``."""

    options: ParallelOptions
    _layout: ParallelLayout | None
    _layout_choices: list[ParallelLayout]
    _requested_sizes: RequestedSizes  # every degree as given ("auto" where allowed)
    _launch_options: LaunchOptions
    _device_mesh: DeviceMesh | None
    _run: ParallelRun | None
    _process_group_backend: str | None

    num_nodes: int

    if TYPE_CHECKING:

        @property
        def precision_plugin(self) -> HybridPrecision: ...

        @precision_plugin.setter
        def precision_plugin(self, precision_plugin: Precision | None) -> None: ...

    @property
    def layout(self) -> ParallelLayout:
        """The resolved sizes and ZeRO stage (``"auto"`` filled in), known once the Trainer is built."""
        if self._layout is None:
            raise RuntimeError(
                "The layout is known once the Trainer has been created with this strategy, or, where the planner"
                " chooses among 'auto' layouts, once the processes have been set up (`setup_environment`)."
            )
        return self._layout

    @property
    def run(self) -> ParallelRun | None:
        """The parallel module of the fit (validate, test, predict) in progress, as ``parallel.parallelize`` made
        it: step runner, pipeline engine, context parallelism, optimizer-state shardings, data-parallel engine;
        None outside a run."""
        return self._run

    @property
    def pipeline(self) -> PipelineEngine | None:
        """This rank's pipeline engine (schedule, stages, microbatches) in a run; None without pipelining."""
        return self._run.pipeline if self._run is not None else None

    @property
    def context_parallel(self) -> ContextParallel | None:
        """This run's context parallelism (batch splitting, attention calls); None without it."""
        return self._run.context if self._run is not None else None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The named device mesh of the run (``(pp, dp, tp)``, with ``cp`` or ``dp_replicate``/``dp_shard``)."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have been initialized.")
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of one tensor/pipeline group reads the same samples: shard data by data-parallel rank only.
        dp_mesh = self.device_mesh[DP_AXIS]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @property
    def is_distributed(self) -> bool:  # Lightning reads it to install a DistributedSampler
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:  # called by the Trainer when the strategy has it (ParallelStrategy has not)
        # Called when the Trainer is built, before processes start: the earliest point the world size is known.
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self.num_processes:
            world = self.num_nodes * self.num_processes
            choices = planner_auto.layout_candidates(world, *self._requested_sizes)
            precision = self.precision_plugin.precision
            check = functools.partial(check_sizes, self.options, precision, self._requested_sizes)
            self._layout_choices = planner_auto.valid_layouts(choices, check)
            self._layout = self._layout_choices[0] if len(self._layout_choices) == 1 else None
            self._check_layout(self._layout)

    def _check_layout(self, layout: ParallelLayout | None) -> None:
        assert self.parallel_devices is not None
        self._launch_options.check_device(self.parallel_devices[0].type)
        sync_batchnorm = layer_sync(self) is not None  # set from Trainer(sync_batchnorm=True) just before this call
        check_trainer_layout(
            layout, self.options, self.precision_plugin, sync_batchnorm, self.num_processes, self.num_nodes
        )
