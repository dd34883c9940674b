"""A run's start under a bound: a rank still starting after ``init_timeout`` says where and why, then ends.

Before a run's first batch each rank waits on the others where nothing else names a culprit: in process-group
initialization (a rank that never arrives: its node lost during start-up, or a restarted round reading the dead
round's keys from torchrun's shared store, where gloo's connect retries need not stop at the collective
``timeout``), in the first collectives (the layout's choice, the device mesh, setup), and in the checkpoint load (a
file system that hangs). Each rank's thread counts from the run's start (``setup_environment``) to its first
training or evaluation loop; past ``init_timeout`` it prints one line naming the rank, the phase and the likely
cause, and ends the process, so that the launcher ends or restarts the job instead of waiting in silence.

Under torchrun and SLURM the launcher stops a node's other ranks as soon as one ended, often before their own bound
expires: while a phase runs, a SIGTERM makes them print the same line (read by this thread from the signal's
wakeup file descriptor, since the main thread may be blocked in C++ where no Python handler runs) before ending.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext

# The phases of a run's start, in order, as the messages name them.
PROCESS_GROUP = "process-group initialization"
FIRST_COLLECTIVES = "the first collectives (the layout's choice, the device mesh)"
USER_HOOKS = "the setup and configure_model hooks"
SETUP = "setup (parallelizing the module and its first collectives)"
RESTORE = "restoring the run's state"
CHECKPOINT_LOAD = "loading the checkpoint"

_PEER = (
    "another rank failed or stopped before the same collective (its own output names it), or waits elsewhere;"
    " a rank stopped without failing is named by the heartbeat"
)
_CAUSES = {
    PROCESS_GROUP: (
        "a rank of this round has not reached it: its process did not start or died before (see its node's"
        " output), or its node cannot reach MASTER_ADDR:MASTER_PORT (firewall, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME)"
    ),
    CHECKPOINT_LOAD: (
        "reading the checkpoint takes longer than the bound (a slow or hung file system, or a checkpoint too large"
        " for it: raise init_timeout), or another rank failed while loading"
    ),
}
_SHARED_STORE = (
    "; or torchrun restarted this round (a node joined or left) on the store it shares with the workers of every"
    " round (TORCHELASTIC_USE_AGENT_STORE=True), and its ranks read the keys the ranks of the round before left:"
    " start torchrun with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in its environment"
)


def likely_cause(phase: str) -> str:
    """What usually keeps a rank in ``phase`` (and torchrun's shared store, where it is in use)."""
    cause = _CAUSES.get(phase, _PEER)
    if phase == PROCESS_GROUP and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return cause + _SHARED_STORE
    return cause


class StartupBound:
    """One rank's bound on its run's start: ``phase`` marks where it is, ``stop()`` ends the bound (the first loop
    started, or teardown)."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        world_size: int,
        describe: Callable[[int], str],
        listen_for_sigterm: bool = False,
        on_expired: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout_s, self.rank, self.world_size, self.describe = timeout_s, rank, world_size, describe
        self.listen_for_sigterm = listen_for_sigterm and threading.current_thread() is threading.main_thread()
        self.on_expired = on_expired or _end_process
        self.current = PROCESS_GROUP
        self._started = time.monotonic()
        self._stopped = threading.Event()
        self._ended = threading.Lock()  # one line per rank: the bound's or the SIGTERM's, whichever comes first
        # One pipe for the bound's life (closed after the thread ended: a descriptor closed under a select could be
        # reused by another file meanwhile); SIGTERM writes to it while a phase listens.
        self._wakeup = os.pipe() if self.listen_for_sigterm else None
        for fd in self._wakeup or ():
            os.set_blocking(fd, False)
        self._previous_fd = -1
        self._listening = False
        self._thread = threading.Thread(target=self._run, name="lightning-mgpu-startup-bound", daemon=True)

    def start(self) -> StartupBound:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._listening and threading.current_thread() is threading.main_thread():
            self._unlisten()
        if self._wakeup is not None:
            _write(self._wakeup[1])
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        wakeup, self._wakeup = self._wakeup, None
        for fd in wakeup or ():
            os.close(fd)

    @contextmanager
    def phase(self, name: str, then: str) -> Generator[None, None, None]:
        """Run the block as phase ``name`` (a SIGTERM meanwhile names it), then mark ``then``."""
        self.current = name
        if self._wakeup is not None and not self._stopped.is_set():
            self._listen()
        try:
            yield
        finally:
            if self._listening:
                self._unlisten()
            self.current = then

    def message(self, elapsed_s: float) -> str:
        return (
            f"lightning-mgpu: {self._me()} still in {self.current} after {elapsed_s:.0f} s"
            f" (init_timeout={self.timeout_s:g} s): {likely_cause(self.current)}. Rank {self.rank} ends so that its"
            " launcher can end or restart the job."
        )

    def _me(self) -> str:
        return f"rank {self.rank} of {self.world_size} ({self.describe(self.rank)})"

    # ---------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        deadline = self._started + self.timeout_s
        wakeup = self._wakeup
        while not self._stopped.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._end(self.on_expired, self.message(time.monotonic() - self._started))
                return
            if wakeup is None:
                self._stopped.wait(remaining)
                continue
            readable, _, _ = select.select([wakeup[0]], [], [], remaining)
            received = os.read(wakeup[0], 64) if readable else b""
            if signal.SIGTERM in received and not self._stopped.is_set():
                self._end(_end_like_sigterm, self._sigterm_message())
                return

    def _sigterm_message(self) -> str:
        elapsed = time.monotonic() - self._started
        return (
            f"lightning-mgpu: {self._me()} stopped by SIGTERM during {self.current}, {elapsed:.0f} s into the run's"
            " start: its launcher ended it (another rank of its node ended or failed first; that rank's output says"
            " why)."
        )

    def _end(self, action: Callable[[str], None], message: str) -> None:
        if self._ended.acquire(blocking=False):
            action(message)

    # ----------------------------------------------------------------------------------- SIGTERM while a phase runs
    def _listen(self) -> None:
        """SIGTERM's handler (main thread) and wakeup descriptor (read by the thread) while a phase runs."""
        if self._wakeup is None or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return  # a handler of the user's or a launcher's: theirs to run
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous_fd = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
        self._listening = True

    def _unlisten(self) -> None:
        """Back to what was there before the phase (Lightning registers its own handlers later, after our phases)."""
        self._listening = False
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """The main thread ran Python code when SIGTERM came: it says so itself."""
        self._end(_end_like_sigterm, self._sigterm_message())


def phase(bound: StartupBound | None, name: str, then: str) -> AbstractContextManager[None]:
    """``bound.phase(name, then)``, or nothing without a bound (``init_timeout=None``, a single process)."""
    return nullcontext() if bound is None else bound.phase(name, then)


def _write(fd: int) -> None:
    try:
        os.write(fd, b"\0")  # wakes the thread's select
    except OSError:
        pass


def _end_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)  # from a thread: the main thread may be blocked in a collective or a connect


def _end_like_sigterm(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGTERM)  # the shell's code for "ended by SIGTERM"
