"""HybridStrategy: the Lightning face of lightning-mgpu.

It owns Lightning's hooks and hands every piece of parallel work to ``layout``, ``parallel/`` and ``checkpoint``:
the layout's checks and planned choice (``layout_choice``), the module made parallel and its optimizers wired
(``setup``); the layout and mesh properties, the step, checkpoint and collective hooks are mixed in from
``layout_hooks``, ``step``, ``checkpoint_hooks`` and ``collectives``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_mgpu import backends
from lightning_mgpu import checkpoint as sharded_checkpoint
from lightning_mgpu._compat.dtensor import equal_over_mesh
from lightning_mgpu._compat.lightning import (
    DeferredRequeue,
    optimizers_to_device,
    reset_optimizers_and_schedulers,
)
from lightning_mgpu.checkpoint.plain import restore_plain
from lightning_mgpu.launch import (
    Heartbeat,
    StartupBound,
    restore_sigterm,
    startup,
)
from lightning_mgpu.layout import PP_AXIS, ParallelLayout, RequestedSizes, Size
from lightning_mgpu.layout_checks import check_options
from lightning_mgpu.options import LaunchOptions, ParallelOptions, StartMethod
from lightning_mgpu.parallel import ParallelRun, parallelize
from lightning_mgpu.parallel.data import can_leave_gathered, reduce_metrics_over
from lightning_mgpu.patches import ModuleSnapshot, PatchLog
from lightning_mgpu.planner import auto as planner_auto
from lightning_mgpu.precision import HybridPrecision
from lightning_mgpu.strategy import setup as module_setup
from lightning_mgpu.strategy.averaging import AveragedCopies
from lightning_mgpu.strategy.batch import keep_global_batch
from lightning_mgpu.strategy.callbacks import check_callbacks
from lightning_mgpu.strategy.checkpoint_hooks import CheckpointHooks
from lightning_mgpu.strategy.collectives import DataParallelCollectives
from lightning_mgpu.strategy.launch_hooks import LaunchHooks
from lightning_mgpu.strategy.layout_hooks import LayoutHooks
from lightning_mgpu.strategy.step import StepHooks
from lightning_mgpu.strategy.weights import WeightsHooks, check_pretrained

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from torch.distributed.device_mesh import DeviceMesh


class HybridStrategy(LaunchHooks, LayoutHooks, StepHooks, CheckpointHooks, WeightsHooks, DataParallelCollectives):
    """Data, tensor, pipeline, context and expert parallelism with ZeRO stages 0-3 for an unchanged LightningModule.

    The sizes multiply to ``devices x num_nodes``: ``world = pp x dp x cp x tp``, tensor parallelism innermost (one
    node's GPUs), the pipeline outermost. ``"auto"`` sizes and ZeRO stage that leave several layouts are chosen at
    setup by the planner for the real module. Arguments are checked when the strategy and the Trainer are built,
    before any process starts, and a bad one is refused naming the value and the fix. An option of a dimension of
    size 1 (e.g. ``pipeline_schedule`` with ``pipeline_parallel_size=1``) is refused rather than ignored.

    Args:
        tensor_parallel_size: Tensor parallel degree (``int`` or ``"auto"``; default ``1``). The layers of each
            block split over this many ranks (Megatron's column/row split through DTensor); heads and hidden sizes
            must divide it. Keep it within one node. Interacts with ``tp_plan``, ``sequence_parallel``,
            ``loss_parallel``.
        pipeline_parallel_size: Pipeline parallel degree (``int`` or ``"auto"``; default ``1``). The module's
            repeated blocks split into stages run by ``torch.distributed.pipelining``; ``training_step`` is
            unchanged. Interacts with ``pipeline_schedule``, ``num_microbatches``, ``stages_per_rank``,
            ``pipeline_split``.
        data_parallel_size: Data parallel degree (default ``"auto"``: the world size divided by
            ``tp x pp x cp``). Each data-parallel rank sees its own samples; ZeRO shards over these ranks.
        zero_stage: ZeRO stage ``0``-``3`` or ``"auto"`` (default ``0``): 0 replicates everything (DDP), 1 shards
            the optimizer states, 2 also the gradients, 3 also the parameters (FSDP2 ``fully_shard``). Interacts
            with ``data_parallel_shard_size``, ``cpu_offload``, ``zero_backend``.
        zero_backend: ``"torch"`` (default: DDP/FSDP2) or ``"deepspeed"``: the data-parallel dimension runs through
            a DeepSpeed engine at ``zero_stage``. DeepSpeed is data parallelism only: tensor/pipeline parallelism
            with it are refused before training.
        deepspeed_config: With ``zero_backend="deepspeed"``: a dict or the path of a JSON file for
            ``deepspeed.initialize`` (offload, bucket sizes, ZeRO++ ...). Precision, clipping, accumulation,
            micro-batch size and stage come from the Trainer and the strategy and may not be contradicted.
            Default ``None``.
        expert_parallel_size: Mixture-of-experts layers hold ``num_experts / n`` experts per rank, tokens routed by
            all-to-all (default ``1``). Composes with ZeRO 0-3, tensor and pipeline parallelism.
        data_parallel_shard_size: HSDP: ZeRO (stages 1-3) shards over groups of this many consecutive
            data-parallel ranks (e.g. one node) and replicates across the groups; must divide the data-parallel
            size. Default ``None``: shard over all of dp.
        context_parallel_size: Split each sequence over this many ranks (a ``cp`` mesh axis; default ``1``).
            Attention through ``F.scaled_dot_product_attention`` runs on the local shard with exact results;
            losses equal the whole sequence's mean. Sequence lengths must be multiples of ``2 x cp`` (two
            load-balanced chunks per rank).
        context_parallel_mode: ``"ring"`` (default: K/V blocks passed around the cp group; any head count) or
            ``"alltoall"`` (Ulysses: heads scattered during attention; heads per tensor-parallel rank divisible by
            cp). Needs ``context_parallel_size > 1``.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments (default ``False``): each repeated
            block's forward is compiled after tensor parallelism and activation checkpointing, before the
            pipeline's and data parallelism's wraps (torchtitan's order), in every layout.
        global_batch_size: Samples per optimizer step over all data-parallel ranks, kept on any world size
            (default ``None``). ``accumulate_grad_batches`` becomes ``N / (batch_size x dp)`` when training starts;
            refused, naming the numbers, when that does not divide or the Trainer says otherwise.
        find_unused_parameters: Where DDP replicates (ZeRO 0/1 without tensor/pipeline parallelism): whether each
            step searches for parameters without a gradient. ``None`` (default) decides from the first
            synchronizing step: if every rank gave every parameter a gradient, the search stops; a later step that
            leaves one without a gradient then stops the run with an error naming ``True``. Set ``True`` for models
            whose steps may leave parameters unused (layer drop, a loss term used on some steps).
        tp_plan: ``"auto"`` (default: derived from the module, or the Hugging Face model's own
            ``base_model_tp_plan``), a dict ``{module_glob: style}`` (``"colwise"``, ``"rowwise"``,
            ``"embedding_rowwise"``, ``"sequence_parallel"``, ... and Hugging Face's style names) or a callable
            ``(module, tp_mesh)`` that parallelizes in place. Needs ``tensor_parallel_size > 1``.
        sequence_parallel: Shard the norms' activations along the sequence between tensor-parallel regions
            (default ``False``). Needs ``tensor_parallel_size > 1``.
        loss_parallel: Keep the LM head's logits sharded over the vocabulary; cross-entropy runs on the shards
            (default ``False``). Needs ``tensor_parallel_size > 1``.
        pipeline_schedule: ``"GPipe"``, ``"1F1B"`` (default), ``"Interleaved1F1B"``, ``"LoopedBFS"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"`` or ``"DualPipeV"``. Needs
            ``pipeline_parallel_size > 1``.
        num_microbatches: Microbatches per step (default ``None``: the number of stages). 1F1B and DualPipeV need
            at least the number of stages, interleaved schedules a multiple of their rounds. A ragged last batch
            runs as the nearest count of equal microbatches (with a warning).
        stages_per_rank: Virtual stages per rank (default ``None``: 1 for GPipe/1F1B, 2 for the looped and V
            schedules). V schedules need exactly 2, looped ones 2 or more.
        pipeline_split: ``"auto"`` (default: balanced by parameters over the repeated blocks, or the children of
            the largest ``Sequential``) or the names of the children of one ``ModuleList``/``Sequential`` where
            stages 1, 2, ... begin.
        activation_checkpointing: ``True``/``"full"`` (each block keeps only its input and recomputes its inside
            in backward), ``"selective"`` (the outputs of matmuls, attention and collectives kept, the cheap ops
            recomputed) or a list of module classes to checkpoint in full (default ``False``).
        cpu_offload: With ``zero_stage=3``: keep sharded parameters, gradients and optimizer states in CPU memory
            (default ``False``).
        checkpoint_format: ``"full"`` (the default without ``async_checkpoint``: one ``torch.save`` file laid out
            like a single-device Lightning checkpoint, which ``MyModule.load_from_checkpoint(path)`` and
            ``torch.load`` read; every rank writes its shards, then global rank 0 joins them into the file, and
            writes the directory instead, with a warning, when the model's and optimizers' states would not fit in
            half of its free memory) or ``"sharded"`` (the default with ``async_checkpoint``: a
            ``torch.distributed.checkpoint`` directory written by all ranks, no rank ever holding the whole
            state; ``lightning-mgpu consolidate`` makes the file). Both load in any layout.
        async_checkpoint: Write sharded checkpoints in the background while training goes on (default ``False``).
        process_group_backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA by default; torch's
            ``"cpu:gloo,cuda:nccl"`` form is accepted; unknown or unavailable backends are refused.
        timeout: Timeout of every collective: a ``timedelta`` or a number of seconds (default 30 minutes, as in
            Lightning). A rank that stops responding ends the job within it.
        start_method: ``"auto"`` (default: ``"popen"``, a subprocess per device, from scripts; ``"fork"`` from
            notebooks and interactive Python), ``"popen"``, ``"fork"``, ``"spawn"`` or ``"forkserver"``. Under
            torchrun or SLURM the launcher's processes are used.
        heartbeat_timeout: Seconds without a heartbeat after which a rank is taken for lost (default ``60``;
            ``None``: no heartbeat). Each rank's thread beats through the process group's store and watches the
            next rank; a rank stopped without failing (SIGSTOP, a frozen node) is then named and the job ended
            within this time instead of the collective ``timeout``, so that torchrun can restart it.
        init_timeout: Seconds a run's start may take on each rank, from process-group initialization through the
            first collectives, setup and the checkpoint load to its first training or evaluation loop (default
            ``600``; ``None``: no bound). A rank still starting then prints the phase it waits in and the likely
            cause and ends, so that a rank that never arrives (a node lost during a restart) ends the job in this
            time, not silently after the collective ``timeout``. Raise it for checkpoints that take longer to read.
        accelerator: Lightning's accelerator (set by the Trainer).
        parallel_devices: Lightning's devices of this node (set by the Trainer).
        cluster_environment: Lightning's cluster environment (set by the Trainer: torchrun, SLURM, ...).
        checkpoint_io: Lightning's checkpoint IO plugin, used by ``checkpoint_format="full"``.
        precision_plugin: A :class:`~lightning_mgpu.HybridPrecision`; the Trainer's ``precision=`` sets it.
        pretrained: Weights to start from (default ``None``): a Hugging Face model directory (``model.safetensors``
            or shards with ``model.safetensors.index.json``), a consolidated torch/Lightning file, or a sharded
            checkpoint of this strategy (weights only, any layout). Each rank reads only the slices it holds, after
            parallelizing; with it set, ``configure_model`` and ``trainer.init_module()`` build the parameters on
            the meta device, so the model is never whole on any rank. Names match through the module's prefix
            (``self.model`` for a Hugging Face model) and the Hugging Face model's own conversions.
        pretrained_strict: With ``pretrained``: refuse, naming them, model entries the checkpoint lacks and
            checkpoint entries the model lacks (default ``True``). ``False`` loads what both have and initializes
            the rest as one process would (a new head).
        restore_module_on_teardown: When ``fit``/``validate``/... ends, give the module back as plain torch on
            every rank, holding the trained weights in full, with the optimizers pointing at its parameters.
            ``False`` leaves it parallelized (sharded parameters, this rank's pipeline stages) for models whose full
            weights do not fit on one device; save them with ``trainer.save_checkpoint``. Default ``None``: ``True``
            unless the parameters were built on the meta device (``pretrained``, ``init_module(empty_init=True)``).

    Example:
        ```python
        import lightning as L
        from lightning_mgpu import HybridStrategy

        strategy = HybridStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1)
        trainer = L.Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)
        assert trainer.strategy.layout.data_parallel_size == 2
        ```

    After the Trainer is built the layout is ``trainer.strategy.layout`` (a frozen :class:`ParallelLayout`); in a
    run the named mesh is ``trainer.strategy.device_mesh``, ``(pp, dp, tp)`` (``(pp, dp, cp, tp)`` with context
    parallelism, ``(pp, dp_replicate, dp_shard, tp)`` with HSDP), also ``self.device_mesh`` in
    ``configure_model``.
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        tensor_parallel_size: Size = 1,
        pipeline_parallel_size: Size = 1,
        data_parallel_size: Size = "auto",
        zero_stage: int | Literal["auto"] = 0,
        zero_backend: str = "torch",
        deepspeed_config: dict | str | None = None,
        expert_parallel_size: int = 1,
        data_parallel_shard_size: int | None = None,
        context_parallel_size: int = 1,
        context_parallel_mode: str = "ring",
        compile: bool | dict[str, Any] = False,
        global_batch_size: int | None = None,
        find_unused_parameters: bool | None = None,
        tp_plan: str | dict[str, str] | Callable[..., None] = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        pipeline_schedule: str = "1F1B",
        num_microbatches: int | None = None,
        stages_per_rank: int | None = None,
        pipeline_split: str | list[str] = "auto",
        activation_checkpointing: bool | str | list[type] = False,
        cpu_offload: bool = False,
        checkpoint_format: str | None = None,
        async_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | int | float | None = default_pg_timeout,
        start_method: StartMethod = "auto",
        heartbeat_timeout: float | None = 60.0,
        init_timeout: float | None = 600.0,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        pretrained: str | os.PathLike | None = None,
        pretrained_strict: bool = True,
        restore_module_on_teardown: bool | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Validate everything that does not need the world size now, before any process is started; the rest when
        # the Trainer is built (`set_world_ranks`, the `precision_plugin` setter), still in the launching process.
        self._requested_sizes = RequestedSizes(
            data_parallel_size,
            tensor_parallel_size,
            pipeline_parallel_size,
            zero_stage,
            context_parallel_size,
            expert_parallel_size,
            data_parallel_shard_size,
        )
        if checkpoint_format is None:  # a background save writes the shards; a file is joined on one rank after
            checkpoint_format = "sharded" if async_checkpoint else "full"
        self._requested_sizes.resolve(self._requested_sizes.smallest_world_size)
        self.options = ParallelOptions(
            zero_backend=zero_backend,
            tp_plan=tp_plan,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            pipeline_schedule=pipeline_schedule,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            pipeline_split=pipeline_split,
            activation_checkpointing=activation_checkpointing,
            cpu_offload=cpu_offload,
            checkpoint_format=checkpoint_format,
            async_checkpoint=async_checkpoint,
            deepspeed_config=deepspeed_config,
            context_parallel_mode=context_parallel_mode,
            compile=compile,
            global_batch_size=global_batch_size,
            find_unused_parameters=find_unused_parameters,
        )
        check_options(self.options, zero_stage, tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
        self._launch_options = LaunchOptions(
            process_group_backend, timeout, start_method, heartbeat_timeout, init_timeout
        )
        self._heartbeat: Heartbeat | None = None
        self._requeue: DeferredRequeue | None = None
        self._startup: StartupBound | None = None
        self._process_group_backend = process_group_backend
        self._timeout = cast(timedelta | None, self._launch_options.timeout)  # LaunchOptions made it a timedelta
        self._start_method = start_method
        self._layout: ParallelLayout | None = None
        # Several layouts the "auto" choices allow: the planner picks one at setup, once the module is known.
        self._layout_choices: list[ParallelLayout] = []
        self._plan: planner_auto.StrategyPlan | None = None
        self._device_mesh: DeviceMesh | None = None
        self._run: ParallelRun | None = None  # the parallel module of one fit/validate/..., made in `setup`
        # The engine of the data-parallel dimension: torch's wraps, or a DeepSpeed engine (built in `setup`).
        self._data_parallel = backends.zero_backend(self.options)
        state_access = self._data_parallel.state_access()
        self._checkpointer = sharded_checkpoint.Checkpointer(checkpoint_format, async_checkpoint, state_access)
        self.num_nodes = 1
        self._pretrained = check_pretrained(pretrained)
        self._pretrained_strict = pretrained_strict
        self._init_rng_state: torch.Tensor | None = None  # the random state parameters built on meta were made in
        self._first_loss_checked: bool | None = None
        # Every patch on the user's objects during one run, and the module as it was, undone in `teardown`.
        self._restore_module = restore_module_on_teardown
        self._restores = restore_module_on_teardown is not False  # this run's choice (None: decided in `setup`)
        self._patches = PatchLog()
        self._snapshot: ModuleSnapshot | None = None
        self._averaged = AveragedCopies()  # weight-averaging callbacks' copies, laid out as the parallel module
        self._failed = False
        self._interrupted = False  # an exception ended the run (a step may have stopped inside a forward)

    @property
    @override
    def precision_plugin(self) -> HybridPrecision:
        plugin = self._precision_plugin if self._precision_plugin is not None else Precision()
        device_type = self.parallel_devices[0].type if self.parallel_devices else "cpu"
        self._precision_plugin = HybridPrecision.from_lightning(plugin, device_type)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = HybridPrecision.handed_over(precision_plugin, self.accelerator)

    @property
    def plan(self) -> planner_auto.StrategyPlan | None:
        """What the planner chose for ``"auto"`` sizes, its prediction and the measured steps (``None``: no choice)."""
        return self._plan

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._end_startup()
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if self.options.global_batch_size is not None:
            keep_global_batch(trainer, self.options.global_batch_size, self.layout.data_parallel_size)
        self._watch_signals(trainer)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        summary = self._plan.measured_beside_predicted() if self._plan is not None else None
        if summary:  # the planner's prediction beside what the steps took
            rank_zero_info(summary)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        with startup.phase(self._startup, startup.SETUP, then=startup.RESTORE):
            self._setup(trainer)

    def _setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        assert self.lightning_module is not None
        if trainer.state.fn == TrainerFn.FITTING:
            callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by the Trainer, not declared
            check_callbacks(callbacks, self.layout, self.options)
        self.accelerator.setup(trainer)
        fp8_gathers = self._data_parallel.gathers_fp8_weights(self.layout)
        self.precision_plugin.float8_all_gather = fp8_gathers and self.precision_plugin.precision == "fp8-mixed"
        self.model = self.precision_plugin.convert_module(self.model)
        run = self._run
        if run is not None and run.runner.module is self.lightning_module:
            self.model = run.runner  # kept parallelized by an earlier fit/validate (restore_module_on_teardown off)
            module_setup.shard_gathered(run.roots)
            if run.context is not None:
                run.context.patch_functions(self._patches)  # undone when that run ended
        else:
            self._failed = self._interrupted = False
            module, mesh, precision = self.lightning_module, self.device_mesh, self.precision_plugin
            # Names checked against the whole module before it is cut up; parameters built on the meta device stay
            # there until each rank holds only its slices.
            weights = self._plan_weights(module)
            if not weights.built_empty:
                self.model_to_device()
            self._restores = self._restore_module if self._restore_module is not None else not weights.built_empty
            if self._restores and self._data_parallel.restores_by_snapshot:
                self._snapshot = ModuleSnapshot.take(self.lightning_module)
            example = module_setup.example_step(trainer, module, self.batch_to_device)
            device, patches, engine = self.root_device, self._patches, self._data_parallel
            run = parallelize(module, self.layout, mesh, self.options, precision, device, patches, engine, example)
            self._run = run
            self._fill_weights(module, weights)
            self.model = run.runner
            module_setup.name_fsdp_roots(run.roots)
            if self._snapshot is not None:
                self._snapshot.release()  # originals the parallel module replaced hold no memory while it trains
        self._patches.add_process_wide(equal_over_mesh())  # torch.equal of DTensors: no world-wide collective
        reduce_metrics_over(self.lightning_module, self._reduce_group, self._patches)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        reshard = partial(module_setup.shard_gathered, run.roots)
        self._averaged.repoint(callbacks, self.lightning_module, reshard, self._patches)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        precision_name = str(self.precision_plugin.precision)
        self.model = run.wrap(self.optimizers, trainer, self.layout, precision_name, self._dp_group)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        reset_optimizers_and_schedulers(self)
        run = self._run
        assert self.lightning_module is not None and run is not None
        run.unwire_optimizers()
        with module_setup.optimizers_of_frozen_stages(self.lightning_module, run.pipeline):
            super().setup_optimizers(trainer)
        module, mesh, precision = self.lightning_module, self.device_mesh, self.precision_plugin
        run.wire_optimizers(self.optimizers, module, self.layout, mesh, precision, self._patches)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        try:
            self._checkpointer.wait()  # a background save finishes (or raises) before `fit` returns
            if self._run is not None:
                self._run.unwire_optimizers(stop_watching_roots=True)
            if self._restores:
                self._restore_user_objects()
            else:
                self._patches.undo_process_wide()  # the module stays parallelized; torch itself does not
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
        finally:
            self._end_startup()
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            restore_sigterm()  # a failure's SIGTERM handler (launch/failures.py) does not outlive the fit

    def _restore_user_objects(self) -> None:
        """Undo every patch on the user's objects and give back the plain module with the trained values.

        After a failure that not every rank shares, only what needs no collective is undone; the module stays
        parallelized.
        """
        snapshot, self._snapshot = self._snapshot, None
        assert self.lightning_module is not None
        if not self._data_parallel.restores_by_snapshot and not self._failed:
            self._data_parallel.release(self.lightning_module)  # collective: DeepSpeed's changes undone in place
            self.model, self._run = self.lightning_module, None
        if snapshot is None or self._failed:
            self._patches.undo()
            return
        run = self._run  # None: `parallelize` raised on every rank, the module half cut; the snapshot restores it
        roots: list[torch.nn.Module] = run.roots if run is not None else [self.lightning_module]
        pipelined = run is not None and run.pipeline is not None
        pp_group = self.device_mesh[PP_AXIS].get_group() if pipelined else None
        if self._interrupted and can_leave_gathered(self.layout):  # only sharded groups can be left so
            module_setup.reshard(roots)
        else:
            # A run that ended with an evaluation (validation at the epoch's end) left FSDP2's root groups gathered
            # (ZeRO-2/3, and FSDP2's replicate beside tp or pp): the module then held the gathered copies, not the
            # parameters the optimizers step and point at.
            module_setup.shard_gathered(roots)
        self._averaged.gather()  # before restore_plain undoes the patches that re-pointed the copies
        restore_plain(snapshot, list(self.optimizers), self._patches, pp_group)
        self.model, self._run = self.lightning_module, None
        gc.collect()  # DDP's reducer (its autograd hooks on the parameters) goes with the step runner

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # `import lightning_mgpu` registers these names whenever Lightning is loaded (lightning_mgpu/__init__.py)
        from lightning_mgpu import _register_names

        _register_names(strategy_registry, cls)
