"""HybridStrategy's launchers: Lightning's, plus a clear report when a rank fails and no orphaned process.

- ``python train.py`` (start method "popen"): :class:`HybridSubprocessScriptLauncher`, Lightning's script launcher.
- notebooks and interactive Python (start method "fork", also "spawn"/"forkserver"):
  :class:`HybridMultiProcessingLauncher`, Lightning's multiprocessing launcher.
- torchrun, SLURM: no launcher; each rank reports for itself (``failures.py``).

When a rank fails, the process that started the ranks prints ``failures.format_report`` (which rank, its
coordinates, its error or signal, then its traceback once) and ends the job.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException
from typing_extensions import override

from lightning_mgpu._compat.lightning import (
    ChildProcessObserver,
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
    set_num_threads_if_needed,
)
from lightning_mgpu.launch.failures import (
    FAILURE_DIR_ENV,
    RankFailedError,
    describe_rank,
    format_report,
    new_failure_dir,
    read_records,
    record_failure,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment

    from lightning_mgpu.layout import ParallelLayout

_PARENT_PID_ENV = "LIGHTNING_MGPU_PARENT_PID"  # given to the script launcher's children only
_GRACE_S = 10.0  # how long the ranks left after a failure get to notice it and end by themselves


class LaunchedStrategy(Protocol):
    """What the launchers read of the ``HybridStrategy`` that made them."""

    num_nodes: int

    @property
    def layout(self) -> ParallelLayout: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


# ----------------------------------------------------------------------------------------- python train.py (popen)
_CHECKPOINT_PATHS = "lightning_mgpu_checkpoint_paths"
# ModelCheckpoint's record of what it saved, which the main process's callback should show after a forked fit.
_CHECKPOINT_PATH_ATTRIBUTES = (
    "last_model_path",
    "best_model_path",
    "best_k_models",
    "kth_best_model_path",
    "best_model_score",
    "kth_value",
)


class HybridSubprocessScriptLauncher(SubprocessScriptLauncher):
    """Lightning's launcher for ``python train.py`` that reports a failed rank first, once, and leaves no orphans.

    Three changes to Lightning's: each child dies with this process (``PR_SET_PDEATHSIG``, so killing the main
    process ends the job); ranks record their failures in a run directory (``failures.py``); Lightning's child
    watcher is replaced by one that polls every second and prints the report before ending the job. The main
    process (rank 0 of its node) prints the report itself when its own ``fit`` fails.
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int,
        strategy: LaunchedStrategy,
        timeout: timedelta | None,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._strategy = strategy
        self._grace_s = _GRACE_S if timeout is None else min(_GRACE_S, timeout.total_seconds())
        self.failure_dir: str | None = None
        self._lock = threading.RLock()  # re-entered by a SIGTERM handler on the reporting thread: it must not block
        self._reported = False

    @override
    def launch(self, function: Callable, *args: object, trainer: pl.Trainer | None = None, **kwargs: object) -> object:
        # Lightning's `launch` with our watcher in place of `_launch_process_observer`.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:  # False again after the first launch
            self.failure_dir = new_failure_dir()
            atexit.register(shutil.rmtree, self.failure_dir, ignore_errors=True)
            os.environ[FAILURE_DIR_ENV] = self.failure_dir  # like Lightning's MASTER_PORT: for this process's ranks
            os.environ[_PARENT_PID_ENV] = str(os.getpid())
            try:
                self.call_children_scripts()
            finally:
                del os.environ[_PARENT_PID_ENV]
            _FailureObserver(self).start()
            atexit.register(self._wait_for_children)
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: signal.Signals) -> None:
        # Lightning ends the children this way after a KeyboardInterrupt (Ctrl-C): not a failure to report.
        self._reported = True
        super().kill(signum)

    def report_failure(self, main_failed_first: bool = False) -> bool:
        """Print the report once: wait (bounded) for the children to end, stop the rest, read what the ranks left.

        ``main_failed_first``: this process's own error is the cause, so the children wait for it in a collective
        and will not end by themselves; they get a moment to record a simultaneous error of their own. Returns
        whether this call printed it.
        """
        with self._lock:
            if self._reported:
                return False
            self._reported = True
            first = self.cluster_environment.node_rank() * self.num_processes
            deadline = time.monotonic() + (0.5 if main_failed_first else self._grace_s)
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            stopped = set()
            for local_rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    stopped.add(first + local_rank)
            exit_codes = {first + i: proc.returncode for i, proc in enumerate(self.procs, start=1)}
            _, report = format_report(
                self.num_processes * self.num_nodes,
                read_records(self.failure_dir),
                exit_codes,
                describe_rank(self._strategy),
                frozenset(stopped),
            )
            sys.stdout.flush()
            print(report, file=sys.stderr, flush=True)
            return True

    def _wait_for_children(self) -> None:
        """At this process's exit: let the children finish (they die with it), and report if one failed (e.g. the
        script caught the error). The watcher thread still runs meanwhile; a hung child ends at the timeout."""
        if self._reported:
            return
        for proc in self.procs:
            proc.wait()
        if any(proc.returncode for proc in self.procs):
            self.report_failure()


class _FailureObserver(ChildProcessObserver):
    """Lightning's watcher of the children, polling every second: on a failure it reports, then ends the job."""

    def __init__(self, launcher: HybridSubprocessScriptLauncher) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=launcher.procs, sleep_period=1)
        self._launcher = launcher

    @override
    def check_children(self) -> bool:
        codes = [proc.poll() for proc in self.child_processes]
        if all(code == 0 for code in codes):
            return True
        if not any(codes):
            return False
        if self._launcher.report_failure():  # False: the main thread reported (or Ctrl-C) and ends the process
            shutil.rmtree(self._launcher.failure_dir or "", ignore_errors=True)  # os._exit skips the atexit removal
            os._exit(1)  # Lightning's watcher SIGKILLs the main process here; exit code 1 says the same more kindly
        return True


def _die_with_launcher() -> None:
    """In a child of the script launcher: die when the launcher dies (Linux), even if busy outside collectives.

    Runs when ``lightning_mgpu`` is imported, the first of our code a child runs. The variable is removed so that
    the child's own children (DataLoader workers) are unaffected.
    """
    parent = os.environ.pop(_PARENT_PID_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


_die_with_launcher()


# ------------------------------------------------------------------------------------------ notebooks (fork, spawn)
class HybridMultiProcessingLauncher(MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, returning the *unsharded* weights to the main process.

    A failed rank raises :class:`RankFailedError` here after the report is printed to stderr (torch's own error
    names whichever process exited first, often a rank that only lost its peer).
    """

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.start_method == "fork"

    @override
    def launch(self, function: Callable, *args: object, trainer: pl.Trainer | None = None, **kwargs: object) -> object:
        failure_dir = new_failure_dir()
        previous = os.environ.get(FAILURE_DIR_ENV)
        os.environ[FAILURE_DIR_ENV] = failure_dir  # read by the workers, which inherit or copy the environment
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except (ProcessRaisedException, ProcessExitedException):
            # torch's join has ended every process by now (SIGTERM, SIGKILL after 30 s).
            strategy = cast(LaunchedStrategy, self.strategy)  # the HybridStrategy that made this launcher
            first = strategy.node_rank * strategy.num_processes
            headline, report = format_report(
                strategy.num_processes * strategy.num_nodes,
                read_records(failure_dir),
                {first + i: proc.exitcode for i, proc in enumerate(self.procs)},
                describe_rank(strategy),
            )
            print(report, file=sys.stderr, flush=True)
            raise RankFailedError(headline) from None
        finally:
            if previous is None:
                os.environ.pop(FAILURE_DIR_ENV, None)
            else:
                os.environ[FAILURE_DIR_ENV] = previous
            shutil.rmtree(failure_dir, ignore_errors=True)

    @override
    def run_worker(self, process_idx: int, *args: object, **kwargs: object) -> None:
        if self.start_method == "fork":
            # A forked child that uses the parent's already-started OpenMP pool can hang (a notebook has usually
            # run torch ops before `fit`): one intra-op thread per process is safe, and right when processes
            # share the machine's cores.
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
        try:
            super().run_worker(process_idx, *args, **kwargs)
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt) or (
                isinstance(error, SystemExit) and not error.code and not isinstance(error, SIGTERMException)
            ):
                raise  # Ctrl-C or the parent's death (torch's SIGINT), or a clean exit: torch's wrapper handles it
            # Recorded for the parent's report, then a quiet exit: the traceback is printed once, by the parent.
            # (A rank stopped by torch's SIGTERM ends in Lightning's SIGTERMException: recorded as an echo.) From
            # here on SIGTERM is ignored: Lightning's handler would run a collective with the failed ranks.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            strategy = cast(LaunchedStrategy, self.strategy)  # the HybridStrategy that made this launcher
            rank = strategy.node_rank * strategy.num_processes + process_idx
            record, written = record_failure(error, rank, os.environ.get(FAILURE_DIR_ENV))
            if not written:
                print(record.traceback, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    @override
    def collect_rank_zero_results(self, trainer: pl.Trainer, results: object) -> WorkerOutput | None:
        strategy = cast(LaunchedStrategy, trainer.strategy)  # a HybridStrategy
        state_dict = strategy.full_state_dict()  # collective: every rank takes part
        if strategy.global_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save(state_dict, weights_path)
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, object]:
        """Lightning's extras plus the checkpoint callback's paths: only ``best_model_path`` travels by default, so
        ``trainer.checkpoint_callback.last_model_path`` would be empty in a notebook after a forked ``fit``."""
        extra = super().get_extra_results(trainer)
        callback = trainer.checkpoint_callback
        if callback is not None:
            paths = {name: getattr(callback, name) for name in _CHECKPOINT_PATH_ATTRIBUTES if hasattr(callback, name)}
            buffer = io.BytesIO()
            torch.save(paths, buffer)  # as Lightning sends its metrics: tensors (scores) as bytes, not shared memory
            extra[_CHECKPOINT_PATHS] = buffer.getvalue()
        return extra

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:  # Lightning's type
        super().update_main_process_results(trainer, extra)
        callback = trainer.checkpoint_callback
        if callback is None or _CHECKPOINT_PATHS not in extra:
            return
        for name, value in torch.load(io.BytesIO(extra[_CHECKPOINT_PATHS]), weights_only=True).items():
            setattr(callback, name, value)
