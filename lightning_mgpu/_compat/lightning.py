"""Lightning internals (checked on lightning 2.6.6).

Lightning's strategies are written against these private helpers too; a third-party strategy has no public
equivalent for most of them:

- Launchers: ``_SubprocessScriptLauncher``, ``_MultiProcessingLauncher`` (and ``_WorkerOutput``),
  ``_ChildProcessObserver`` are the only implementations of ``python train.py`` re-launching and fork/spawn;
  the classes below expose the hooks we override (``_call_children_scripts``, ``_wrapping_function``,
  ``_collect_rank_zero_results``, ``_run``) under public names.
- Distributed helpers (``lightning.fabric.utilities.distributed``): process-group setup and the reduce/gather
  that Lightning's own ``ParallelStrategy`` subclasses use, so that ``self.log(sync_dist=True)`` behaves the same.
- Strategy internals: ``Strategy._configure_launcher`` (``StrategyHooks``), ``Strategy._layer_sync``
  (``Trainer(sync_batchnorm=True)``) and ``_reset_optimizers_and_schedulers`` (what ``Strategy.setup_optimizers``
  does before building optimizers).
- Precision utilities: ``_optimizer_handles_unscaling``, ``_convert_fp_tensor``, ``_DtypeContextManager``,
  ``Precision._after_closure`` (runs ``on_before_optimizer_step`` and clipping after the closure).
- Module internals: ``LightningModule._device_mesh``, what its public ``device_mesh`` property returns (no public
  setter; Lightning's ``ModelParallelStrategy`` sets it the same way).
- Trainer internals: ``LightningModule._trainer`` (``.trainer`` raises when detached), the fit loop's data source
  and data fetcher, the fetcher's profiler hooks (``_start_profiler``/``_stop_profiler``: where a batch waits for
  data), and ``trainer.call``'s hook dispatchers.
- Signal internals (``quiet_sigterm_notifier``, ``defer_slurm_requeue``): the trainer's ``_signal_connector`` and
  the ``_HandlersCompose`` it registers for SIGTERM and SLURM's requeue signal; its ``_sigterm_notifier_fn`` runs a
  ``dist.broadcast`` and its ``_slurm_sigusr_handler_fn`` a checkpoint save (collectives) inside the signal handler.
- Checkpoint loading (``read_directories_in_load_from_checkpoint``): ``lightning.pytorch.core.saving.pl_load``,
  the function ``LightningModule.load_from_checkpoint`` opens its path with (as a file: a sharded directory failed
  with ``IsADirectoryError``); no public hook of the loader reads anything else.
- Weight averaging (``strategy/averaging.py``): ``WeightAveraging._average_model`` (the ``AveragedModel`` its
  ``setup`` deep-copies from the module before the strategy parallelizes it; no public accessor), its ``_device``,
  and ``_swap_models``/``_copy_average_to_current``, the two methods that copy values between the copy and the
  module.
- Logging internals (``RepeatedLog``): the trainer's result collection (``trainer._results``: ``update_metrics``,
  ``_extract_batch_size``), the logger connector's ``should_reset_tensors``/``_current_fx`` and the module's
  ``_current_fx_name``, to repeat a ``self.log`` call without rebuilding what the first call registered.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TypeAlias

import torch
from lightning.pytorch.strategies import ParallelStrategy, Strategy

from lightning_mgpu._compat import changed, internal

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Optimizable
    from lightning.pytorch.loops.fetchers import _DataFetcher
    from lightning.pytorch.plugins import LayerSync, Precision
    from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric
    from torch.distributed import Store
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mgpu.layout import ModuleMesh

PATH = str | Path  # Lightning's `_PATH`
DataFetcher: TypeAlias = "_DataFetcher"  # the fit loop's fetcher, for annotations outside _compat

# ------------------------------------------------------------------------------------------------------ launchers
_SubprocessScriptLauncher = internal(
    "lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"
)
_MultiProcessingLauncher = internal(
    "lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"
)
_ChildProcessObserver = internal("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver")
WorkerOutput = internal("lightning.pytorch.strategies.launchers.multiprocessing", "_WorkerOutput")
set_num_threads_if_needed = internal("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed")


class SubprocessScriptLauncher(_SubprocessScriptLauncher):  # type: ignore[misc, valid-type]
    """Lightning's ``python train.py`` launcher; ``call_children_scripts`` starts the other local ranks."""

    def call_children_scripts(self) -> None:
        self._call_children_scripts()


class ChildProcessObserver(_ChildProcessObserver):  # type: ignore[misc, valid-type]
    """Lightning's watcher thread of the children; override ``check_children`` (True: stop watching)."""

    @property
    def child_processes(self) -> list[subprocess.Popen]:
        return self._child_processes

    def _run(self) -> bool:
        return self.check_children()

    def check_children(self) -> bool:
        return super()._run()


class MultiProcessingLauncher(_MultiProcessingLauncher):  # type: ignore[misc, valid-type]
    """Lightning's fork/spawn launcher; override ``run_worker`` (a child's entry) and
    ``collect_rank_zero_results`` (what rank 0 sends back)."""

    @property
    def start_method(self) -> str:
        return self._start_method

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def _wrapping_function(self, process_idx: int, *args: object, **kwargs: object) -> None:
        self.run_worker(process_idx, *args, **kwargs)

    def run_worker(self, process_idx: int, *args: object, **kwargs: object) -> None:
        super()._wrapping_function(process_idx, *args, **kwargs)

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: object) -> object:
        return self.collect_rank_zero_results(trainer, results)

    def collect_rank_zero_results(self, trainer: pl.Trainer, results: object) -> object:
        return super()._collect_rank_zero_results(trainer, results)


class StrategyHooks:
    """Mix in before a Lightning ``Strategy``: its private ``_configure_launcher`` hook (called by the Trainer to
    pick the launcher) as ``configure_launcher``."""

    def _configure_launcher(self) -> None:
        self.configure_launcher()

    def configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]


# ------------------------------------------------------------------------------------------ distributed helpers
all_gather_ddp_if_available = internal("lightning.fabric.utilities.distributed", "_all_gather_ddp_if_available")
sync_ddp_if_available = internal("lightning.fabric.utilities.distributed", "_sync_ddp_if_available")
init_dist_connection = internal("lightning.fabric.utilities.distributed", "_init_dist_connection")
default_process_group_backend = internal(
    "lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"
)
materialize_distributed_module = internal("lightning.fabric.utilities.init", "_materialize_distributed_module")
optimizers_to_device = internal("lightning.fabric.utilities.optimizer", "_optimizers_to_device")
set_sampler_epoch = internal("lightning.fabric.utilities.data", "_set_sampler_epoch")
IS_INTERACTIVE: bool = internal("lightning.fabric.utilities.imports", "_IS_INTERACTIVE")


# --------------------------------------------------------------------------------------------- strategy internals
def layer_sync(strategy: ParallelStrategy) -> LayerSync | None:
    """The ``LayerSync`` plugin the Trainer gave the strategy (``sync_batchnorm=True``), or None."""
    _check_attribute(strategy, "_layer_sync", "Strategy")
    return strategy._layer_sync


def reset_optimizers_and_schedulers(strategy: Strategy) -> None:
    strategy._reset_optimizers_and_schedulers()


# -------------------------------------------------------------------------------------------- precision utilities
optimizer_handles_unscaling = internal("lightning.fabric.plugins.precision.amp", "_optimizer_handles_unscaling")
convert_fp_tensor = internal("lightning.fabric.plugins.precision.utils", "_convert_fp_tensor")
DtypeContextManager = internal("lightning.fabric.plugins.precision.utils", "_DtypeContextManager")


def after_closure(plugin: Precision, model: pl.LightningModule, optimizer: Optimizable) -> None:
    """``Precision._after_closure``: ``on_before_optimizer_step`` and gradient clipping, after the closure ran."""
    plugin._after_closure(model, optimizer)


# ----------------------------------------------------------------------------------------------- trainer internals
def set_device_mesh(module: pl.LightningModule, mesh: DeviceMesh | ModuleMesh) -> None:
    """Make ``mesh`` what ``module.device_mesh`` returns (a user's ``configure_model`` may read it)."""
    _check_attribute(module, "_device_mesh", "LightningModule")
    module._device_mesh = mesh  # type: ignore[assignment]  # a ModuleMesh stands in for the DeviceMesh it wraps


def attached_trainer(module: object) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or None (``module.trainer`` raises when there is none)."""
    from lightning.pytorch import LightningModule

    if not isinstance(module, LightningModule):
        return None
    _check_attribute(module, "_trainer", "LightningModule")
    return module._trainer


def fit_data_source(trainer: pl.Trainer) -> _DataLoaderSource:
    """The fit loop's ``_DataLoaderSource`` (``instance``: what was given to ``fit``; ``dataloader()``)."""
    _check_attribute(trainer.fit_loop, "_data_source", "_FitLoop")
    return trainer.fit_loop._data_source


def fit_data_fetcher(trainer: pl.Trainer) -> _DataFetcher | None:
    """The fit loop's current data fetcher (None before the first epoch)."""
    _check_attribute(trainer.fit_loop, "_data_fetcher", "_FitLoop")
    return trainer.fit_loop._data_fetcher


def fetcher_profiler_hooks(fetcher: _DataFetcher) -> tuple[Callable[[], None], Callable[[], None]] | None:
    """The fetcher's ``(start, stop)`` hooks around waiting for a batch, or None for a fetcher without them."""
    if not hasattr(fetcher, "_start_profiler"):
        return None
    return fetcher._start_profiler, fetcher._stop_profiler


def set_fetcher_profiler_hooks(fetcher: _DataFetcher, start: Callable[[], None], stop: Callable[[], None]) -> None:
    fetcher._start_profiler, fetcher._stop_profiler = start, stop


def call_callback_hooks(trainer: pl.Trainer, hook: str, *args: object) -> None:
    internal("lightning.pytorch.trainer.call", "_call_callback_hooks")(trainer, hook, *args)


def call_lightning_module_hook(trainer: pl.Trainer, hook: str, *args: object) -> object:
    return internal("lightning.pytorch.trainer.call", "_call_lightning_module_hook")(trainer, hook, *args)


# ------------------------------------------------------------------------------------------------ weight averaging
WEIGHT_AVERAGING_TRANSFERS = ("_swap_models", "_copy_average_to_current")


def weight_averaging_copy(callback: object) -> torch.optim.swa_utils.AveragedModel | None:
    """The ``AveragedModel`` a ``WeightAveraging`` callback built in ``setup`` (None outside ``fit``)."""
    _check_attribute(callback, "_average_model", "WeightAveraging")
    return callback._average_model  # type: ignore[attr-defined]


def weight_averaging_device(callback: object) -> torch.device | int | None:
    """The device a ``WeightAveraging`` callback was asked to keep its copy on (None: the module's)."""
    _check_attribute(callback, "_device", "WeightAveraging")
    return callback._device  # type: ignore[attr-defined]


def weight_averaging_transfers(callback: object) -> dict[str, Callable[..., None]]:
    """The callback's bound methods that copy values between its averaged copy and the module, by name."""
    for name in WEIGHT_AVERAGING_TRANSFERS:
        _check_attribute(callback, name, "WeightAveraging")
    return {name: getattr(callback, name) for name in WEIGHT_AVERAGING_TRANSFERS}


# ----------------------------------------------------------------------------------------------- logging internals
class RepeatedLog:
    """``module.log(name, value, **options)`` for values logged again and again with the same options.

    ``LightningModule.log`` checks its arguments, rebuilds the logged metric's metadata and walks the metric's
    attributes to move them to the value's device (``_ResultMetric.to``, which deep-copies the metadata) on every
    call: ~0.6 ms of CPU, about a fifth of what a small pipeline's step costs beyond the same schedule run by hand.
    Once a full call has registered the metric, a repeat in the same hook and dataloader, with the same options, on
    the same device, only needs what the full call ends with: the batch size and ``update_metrics``. Anything else
    (a new hook or epoch's first call, a reset collection, another dataloader, other options, another device) takes
    the full call again.
    """

    def __init__(self) -> None:
        # name -> (result collection, key, its _ResultMetric, hook name, options) of the last full call
        self._registered: dict[str, tuple[_ResultCollection, str, _ResultMetric, str | None, dict]] = {}

    def log(self, module: pl.LightningModule, name: str, value: torch.Tensor, options: dict) -> None:
        trainer, fx = module._trainer, module._current_fx_name
        if trainer is not None and self._repeat(trainer, fx, name, value, options):
            return
        module.log(name, value, **options)
        results = trainer._results if trainer is not None else None
        key = f"{fx}.{name}"
        if results is not None and options.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
            key += f".{results.dataloader_idx}"
        metric = results.get(key) if results is not None else None
        if results is not None and metric is not None and torch.is_tensor(value):  # (a metric implies results)
            self._registered[name] = (results, key, metric, fx, dict(options))
        else:
            self._registered.pop(name, None)

    def _repeat(self, trainer: pl.Trainer, fx: str | None, name: str, value: torch.Tensor, options: dict) -> bool:
        registered = self._registered.get(name)
        if registered is None or not torch.is_tensor(value) or value.numel() != 1:
            return False
        results, key, metric, registered_fx, registered_options = registered
        if (
            trainer._results is not results
            or results.dataloader_idx != metric.meta.dataloader_idx  # another dataloader: its own key, or an error
            or results.get(key) is not metric
            or fx != registered_fx
            or options != registered_options
            # (fx is the registered hook's name here: Lightning's full call refuses to log outside a hook)
            or trainer._logger_connector.should_reset_tensors(fx)  # type: ignore[arg-type]
            or getattr(metric, "value", value).device != value.device
        ):
            return False
        value = value.detach().clone().squeeze()  # as LightningModule.log takes a tensor
        batch_size = results._extract_batch_size(metric, options.get("batch_size"), metric.meta)
        results.update_metrics(key, value, batch_size)
        trainer._logger_connector._current_fx = fx
        return True

    def clear(self) -> None:
        """Forget the registered metrics (and with them the trainer's result collections)."""
        self._registered.clear()


def _check_attribute(owner: object, name: str, where: str) -> None:
    """Raise if Lightning's ``owner`` no longer has its private ``name`` (read by the caller right after)."""
    if name not in vars(owner) and not hasattr(type(owner), name):
        raise AttributeError(changed(f"{where}.{name}", "lightning", "the attribute is gone"))


def quiet_sigterm_notifier(trainer: pl.Trainer) -> Callable[[], None] | None:
    """Lightning's SIGTERM notifier of this run without its broadcast; returns the undo (None: nothing to change).

    Lightning's notifier broadcasts from rank 0 inside the signal handler so that every rank learns of a SIGTERM.
    Where every rank is signalled at once (torchrun, SLURM) that is not needed, and where a rank has died (torchrun
    signals the others because one failed) the broadcast meets the dead rank: gloo's error is raised from inside
    the handler, wherever the rank was, and the rank may end without saying why. The replacement does the rest of
    what the notifier does: the launcher's children killed, ``received_sigterm`` set (the loop then stops).
    """
    import signal
    import threading

    _check_attribute(trainer, "_signal_connector", "Trainer")
    connector = trainer._signal_connector
    composed = signal.getsignal(signal.SIGTERM)
    handlers = getattr(composed, "signal_handlers", None)
    _check_attribute(type(connector), "_sigterm_notifier_fn", "_SignalConnector")
    notifier = type(connector)._sigterm_notifier_fn
    if not isinstance(handlers, list) or threading.current_thread() is not threading.main_thread():
        return None
    found = [i for i, h in enumerate(handlers) if getattr(h, "__func__", None) is notifier]
    if not found:
        return None

    def notify(signum: int, frame: FrameType | None) -> None:
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        connector.received_sigterm = True

    original = handlers[found[0]]
    handlers[found[0]] = notify

    def undo() -> None:
        if notify in handlers:
            handlers[handlers.index(notify)] = original

    return undo


class DeferredRequeue:
    """SLURM's requeue signal (``--signal=SIGUSR1@90``) noted in the handler, and Lightning's requeue (save a
    checkpoint, ``scontrol requeue``) run later by every rank at the same step (``at_step_start``).

    Lightning saves inside the signal handler, wherever each rank was: SLURM signals every task at once, but a rank
    in the data loader or a callback handles it at once while the others are inside a step's collectives, which
    then pair with the save's (gloo: "Received data size doesn't match expected size", the job aborted). The first
    rank to see the signal names a step two ahead in the process group's store (ranks are at most one step apart:
    a step's collectives hold them together); every rank reads the store at each step's start (no collective, no
    device synchronization) and requeues at that step.
    """

    _runs = 0  # fits of this process: every rank runs the same sequence, so they agree on the key

    def __init__(self, handlers: list[object], index: int, signum: int, store: Store) -> None:
        DeferredRequeue._runs += 1
        self._key = f"lightning_mgpu/slurm_requeue/{DeferredRequeue._runs}"
        self._store, self._requested, self._published, self._done = store, False, False, False
        self._handlers, self._original, self._signum = handlers, handlers[index], signum
        handlers[index] = self._note

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._requested = True  # no store call here: the main thread may be inside one

    def at_step_start(self, step: int) -> None:
        if self._done:
            return
        if self._requested and not self._published:
            self._store.compare_set(self._key, "", str(step + 2))  # the first rank's step wins
            self._published = True
        if self._store.check([self._key]) and step >= int(self._store.get(self._key)):
            self._done = True
            self._original(self._signum, None)  # type: ignore[operator]  # Lightning's bound handler

    def undo(self) -> None:
        if self._note in self._handlers:
            self._handlers[self._handlers.index(self._note)] = self._original


def defer_slurm_requeue(trainer: pl.Trainer, store: Store) -> DeferredRequeue | None:
    """Lightning's SLURM requeue handler of this run replaced by a note (None: SLURM auto-requeue is off)."""
    import signal
    import threading

    from lightning.fabric.plugins.environments import SLURMEnvironment

    _check_attribute(trainer, "_signal_connector", "Trainer")
    environment = getattr(trainer.strategy, "cluster_environment", None)  # a ParallelStrategy's
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    signum = environment.requeue_signal or signal.SIGUSR1
    handlers = getattr(signal.getsignal(signum), "signal_handlers", None)
    _check_attribute(type(trainer._signal_connector), "_slurm_sigusr_handler_fn", "_SignalConnector")
    requeue = type(trainer._signal_connector)._slurm_sigusr_handler_fn
    if not isinstance(handlers, list):
        return None
    found = [i for i, h in enumerate(handlers) if getattr(h, "__func__", None) is requeue]
    return DeferredRequeue(handlers, found[0], signum, store) if found else None


def read_directories_in_load_from_checkpoint(read: Callable[[Path], dict[str, object] | None]) -> None:
    """``load_from_checkpoint`` given a directory asks ``read`` first (``None``: not ours, Lightning opens it as it
    does); everything else goes to Lightning's own loader. Process-wide, once."""
    import importlib

    names = vars(importlib.import_module("lightning.pytorch.core.saving"))  # pl_load: an import, not re-exported
    load = names["pl_load"]
    if getattr(load, "_lightning_mgpu_reads_directories", False):
        return

    def pl_load(path_or_url: object, map_location: object = None, weights_only: bool | None = None) -> object:
        if isinstance(path_or_url, str | os.PathLike) and Path(path_or_url).is_dir():
            found = read(Path(path_or_url))
            if found is not None:
                return found
        return load(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._lightning_mgpu_reads_directories = True  # type: ignore[attr-defined]  # a marker: patched once
    names["pl_load"] = pl_load
