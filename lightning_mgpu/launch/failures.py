"""When one rank of a job fails: say which rank and why, first and once, then give its details.

A rank that fails inside ``Trainer.fit``/``validate``/``test``/``predict`` records its error
(``HybridStrategy.on_exception`` calls :func:`handle_rank_failure`) as a small JSON file in a directory of the run.
An error that only echoes another rank's failure (a collective whose peer died: gloo's "Connection reset by peer",
NCCL's abort, a timeout) is marked *secondary*. The process that watches the ranks (the main process of the script
launcher, the parent of the fork launcher, see ``launch.py``) reads the records and the exit codes and prints
:func:`format_report`: the failing rank, its mesh coordinates and its error's first line or its signal, then that
rank's traceback once; the ranks under it stay quiet. Under torchrun or SLURM nobody watches the ranks from Python:
a failing rank prints a one-line header and its traceback (once per node for an error every rank raises), a
survivor one line naming the failed rank when a record on its node says so, and torchrun's own summary names the
root cause (we fill its error file).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

FAILURE_DIR_ENV = "LIGHTNING_MGPU_FAILURE_DIR"  # set by our launchers for the ranks they start
_PREFIX = "lightning-mgpu:"
_SOURCE_PREFIX = re.compile(r"^\[[^]]*:\d+\]\s*")  # "[/pytorch/third_party/gloo/.../pair.cc:537] "
_STARTED = time.time()  # records older than this process are from an earlier run with the same name
# Messages of errors that only say a peer is gone or late (gloo, NCCL, the TCP store).
_PEER_LOST = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "remote worker",
    "timed out",
    "timing out",  # NCCL's watchdog
    "communicator was aborted",
    "connection refused",
)


class RankFailedError(RuntimeError):
    """A rank of the job failed; the message is the report's first line (the whole report went to stderr)."""


@dataclass
class FailureRecord:
    rank: int
    error: str  # "ValueError: boom": the type and the first line of the message
    traceback: str
    secondary: bool  # the error is a collective's report that a peer died or hung
    time: float


def is_secondary(exception: BaseException) -> bool:
    """Whether the error (or one it was raised from) is a communication failure caused by another rank."""
    import torch.distributed as dist

    seen: set[int] = set()
    error: BaseException | None = exception
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError) or (
            isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _PEER_LOST)
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def error_line(exception: BaseException) -> str:
    """``"ValueError: boom"``: the type and the message's first line (less gloo's ``[.../pair.cc:537]`` prefix)."""
    lines = str(exception).strip().splitlines()
    if not lines:
        return type(exception).__name__
    return f"{type(exception).__name__}: {_SOURCE_PREFIX.sub('', lines[0])[:300]}"


def coordinates(rank: int, mesh_shape: tuple[int, ...]) -> str:
    """The rank's place in the row-major ``(pp, dp, tp)`` mesh, e.g. ``"pp 0, dp 1, tp 0"`` (``(pp, dp, cp, tp)``
    with context parallelism: ``"pp 0, dp 1, cp 0, tp 0"``)."""
    names = ("pp", "dp", "tp") if len(mesh_shape) == 3 else ("pp", "dp", "cp", "tp")
    place, rest = [], rank
    for name, size in reversed(list(zip(names, mesh_shape))):
        place.append(f"{name} {rest % size}")
        rest //= size
    return ", ".join(reversed(place))


def describe_rank(strategy: Any) -> Callable[[int], str]:
    """A rank's coordinates in ``strategy``'s layout, or "no layout" while none is resolved."""

    def describe(rank: int) -> str:
        try:
            return coordinates(rank, strategy.layout.mesh_shape)
        except Exception:  # a layout that failed to resolve, or is not chosen yet: the rank number alone
            return "no layout"

    return describe


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without a recorded Python error (its own output above may say why)"


# ------------------------------------------------------------------------------------------------------- records
def write_record(directory: str, record: FailureRecord) -> None:
    """Write ``rank<N>.json`` once (the first failure of a rank is the one that counts), atomically."""
    path = Path(directory, f"rank{record.rank}.json")
    if path.exists() and path.stat().st_mtime >= _STARTED:
        return
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)


def read_records(directory: str | None) -> dict[int, FailureRecord]:
    records: dict[int, FailureRecord] = {}
    for path in Path(directory).glob("rank*.json") if directory else ():
        try:
            record = FailureRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if record.time >= _STARTED:  # not left by an earlier run: every rank of a run starts before any fails
            records[record.rank] = record
    return records


def format_report(
    world_size: int,
    records: dict[int, FailureRecord],
    exit_codes: dict[int, int | None],
    describe_rank: Callable[[int], str],
    stopped: frozenset[int] = frozenset(),
) -> tuple[str, str]:
    """The one-line headline and the full report: who failed first, how, the other ranks, then the traceback.

    ``exit_codes`` maps ranks to their exit codes where known (None: still running or not a child); ``stopped``
    are ranks the launcher killed after the failure, which are not causes.
    """
    if any(r.error == "KeyboardInterrupt" for r in records.values()):
        return f"{_PREFIX} interrupted (KeyboardInterrupt)", f"{_PREFIX} interrupted (KeyboardInterrupt)"
    primary = sorted((r for r in records.values() if not r.secondary), key=lambda r: r.time)
    died = [rank for rank, code in sorted(exit_codes.items()) if code and rank not in records and rank not in stopped]
    silent: list[int] = []
    if not primary and not died:  # only echoes, e.g. of a rank that hangs: name the silent ranks, then the echo
        silent = sorted(stopped - set(records))
        primary = sorted(records.values(), key=lambda r: r.time)[:1]
    lines = []
    if silent:
        lines.append(
            f"{_PREFIX} {_ranks(silent, world_size, describe_rank)} stopped responding and had to be"
            " stopped (the other ranks' collectives failed or timed out waiting for it)"
        )
    by_error: dict[str, list[int]] = {}
    for record in primary:
        by_error.setdefault(record.error, []).append(record.rank)
    for error, ranks in by_error.items():
        lines.append(f"{_PREFIX} {_ranks(ranks, world_size, describe_rank)} failed: {error}")
    for rank in died:
        lines.append(f"{_PREFIX} {_ranks([rank], world_size, describe_rank)} {describe_exit(exit_codes[rank] or 0)}")
    causes = {r.rank for r in primary} | set(died) | set(silent)
    others = sorted((set(exit_codes) | set(records) | set(stopped)) - causes)
    if others:
        notes = [f"{r} ({'lost its peers' if r in records else 'stopped'})" for r in others]
        lines.append(f"{_PREFIX} the job ended; the other ranks: " + ", ".join(notes))
    headline = lines[0] if lines else f"{_PREFIX} a rank failed"
    if primary:
        lines.append(f"{_PREFIX} traceback of rank {primary[0].rank}:")
        lines.append(primary[0].traceback.rstrip())
    return headline, "\n".join(lines)


def _ranks(ranks: list[int], world_size: int, describe_rank: Callable[[int], str]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} of {world_size} ({describe_rank(ranks[0])})"
    if len(ranks) == world_size:
        return f"all {world_size} ranks"
    return f"ranks {', '.join(map(str, ranks))} of {world_size}"


# --------------------------------------------------------------------------------------------------- worker side
def record_failure(exception: BaseException, rank: int, directory: str | None) -> tuple[FailureRecord, bool]:
    """Describe this rank's failure and write it to ``directory``; returns the record and whether it was written."""
    record = FailureRecord(
        rank=rank,
        error=error_line(exception),
        traceback="".join(traceback.format_exception(type(exception), exception, exception.__traceback__)),
        secondary=is_secondary(exception) or not isinstance(exception, Exception),  # SIGTERMException: stopped
        time=time.time(),
    )
    try:
        os.makedirs(directory, exist_ok=True)  # type: ignore[arg-type]
        write_record(directory, record)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return record, False
    return record, True


def handle_rank_failure(
    exception: BaseException,
    rank: int,
    world_size: int,
    mesh_shape: tuple[int, ...],
    report_from_main: Callable[[bool], None] | None = None,
) -> None:
    """Record this rank's failure and decide what this process prints if the error ends it.

    ``report_from_main``: this process is the script launcher's main process, which reports for all ranks; it is
    called with whether this rank's own error is the cause (not an echo). Under our launchers printing happens in a
    ``sys.excepthook`` that acts only on this very exception reaching the top level (a user who catches it sees
    nothing change) and hands every other exception to the hook it found; under torchrun or SLURM each rank prints
    its own line at once (the launcher may stop it any moment now).
    """
    if isinstance(exception, KeyboardInterrupt) and os.environ.get(FAILURE_DIR_ENV):
        # Ctrl-C reaches every process of a script launcher: its report must not blame the first rank to exit.
        record_failure(exception, rank, os.environ[FAILURE_DIR_ENV])
        return
    external = report_from_main is None and not os.environ.get(FAILURE_DIR_ENV)  # torchrun, SLURM: no report for us
    if isinstance(exception, SIGTERMException) and world_size > 1 and external:
        # torchrun/SLURM stopped this rank before any collective failed here (it was between them): Lightning ends
        # it with a SystemExit, which no excepthook sees, so this rank says now why it stopped.
        directory = _external_failure_dir()
        record, written = record_failure(exception, rank, directory)
        _print_own_failure(record, world_size, mesh_shape, directory if written else None)
        return
    if not isinstance(exception, Exception) or isinstance(exception, RankFailedError) or world_size == 1:
        return  # SystemExit, the fork launcher's report reaching its parent, or no other rank
    launched = os.environ.get(FAILURE_DIR_ENV)
    directory = launched or _external_failure_dir()
    record, written = record_failure(exception, rank, directory)
    external = report_from_main is None and not (launched and written)
    if report_from_main is not None:
        _install_excepthook(exception, lambda: report_from_main(not record.secondary))
    elif not external:
        _install_excepthook(exception, lambda: None)  # the launcher prints the report with our traceback
    else:
        # torchrun/SLURM: this rank says what it knows now (below). At exit would be too late: torchrun stops the
        # survivors as soon as one rank has exited, and once Lightning's teardown has put back the default SIGTERM
        # action (the moments before the exception reaches the top), that ends a rank without a word.
        where = directory if written else None
        _install_excepthook(exception, _once(lambda: _print_own_failure(record, world_size, mesh_shape, where)))
    if threading.current_thread() is threading.main_thread():
        # A launcher's SIGTERM now prints what is pending and ends this rank: Lightning's handler would run a
        # collective with the failed rank. Installed once the lines to print are known (a SIGTERM in between would
        # end the rank silently). The strategy's teardown puts the replaced handler back (`restore_sigterm`).
        global _sigterm_before
        current = signal.getsignal(signal.SIGTERM)
        if current is not _say_then_end:
            _sigterm_before = current
        signal.signal(signal.SIGTERM, _say_then_end)
    if external and _hook_target is not None:
        _hook_target[2]()  # printed once: a SIGTERM meanwhile or the excepthook at exit then print nothing more


def _once(action: Callable[[], None]) -> Callable[[], None]:
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run


def restore_sigterm() -> None:
    """Put back the SIGTERM handler a failure replaced (called at teardown): a failure before Lightning registered
    its own handlers leaves Lightning nothing to restore, and the user's process must keep no handler of ours."""
    global _sigterm_before
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _say_then_end:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if _sigterm_before is None else _sigterm_before)
    _sigterm_before = None


def _say_then_end(signum: int, frame: object) -> None:
    """SIGTERM after a failure: print now what the excepthook would print at exit, then end as SIGTERM does.

    torchrun stops the survivors as soon as one rank has exited, often while they are still in Lightning's teardown:
    with the default action they would end without their line naming the failed rank.
    """
    global _hook_target
    target, _hook_target = _hook_target, None
    try:
        if target is not None:
            target[2]()
    finally:  # even if printing failed (e.g. interrupted inside a write to stderr): the signal still ends the rank
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _print_own_failure(
    record: FailureRecord, world_size: int, mesh_shape: tuple[int, ...], directory: str | None
) -> None:
    """torchrun/SLURM: no launcher reports for us, so each rank says what it knows, briefly when it is an echo."""
    me = f"rank {record.rank} of {world_size} ({coordinates(record.rank, mesh_shape)})"
    if record.secondary:
        causes = sorted((r for r in read_records(directory).values() if not r.secondary), key=lambda r: r.time)
        if causes:
            cause = f"rank {causes[0].rank} failed: {causes[0].error}"
        elif record.error.startswith(SIGTERMException.__name__):
            cause = "its launcher or scheduler sent SIGTERM; see the other ranks' output"
        else:
            cause = f"another rank failed or stopped ({record.error[:200]}); see the other ranks' output"
        print(f"{_PREFIX} {me} stopped: {cause}", file=sys.stderr, flush=True)
        return
    print(f"{_PREFIX} {me} failed: {record.error}", file=sys.stderr)
    if directory is not None and not _claim(directory, record.error):  # e.g. a configuration error on every rank
        print(f"{_PREFIX} (the same error as another rank on this node, which shows the traceback)", file=sys.stderr)
    elif _write_torchelastic_error_file(record):
        print(f"{_PREFIX} the traceback is in torchrun's error summary", file=sys.stderr)
    else:
        print(record.traceback.rstrip(), file=sys.stderr)
    sys.stderr.flush()


def _write_torchelastic_error_file(record: FailureRecord) -> bool:
    """Fill torchrun's error file, so its summary names our error as the root cause with its traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    extra = {"py_callstack": record.traceback, "timestamp": str(int(record.time))}
    data = {"message": {"message": record.error, "extraInfo": extra}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        return False
    return True


def _claim(directory: str, key: str) -> bool:
    """True for the first process on this node that claims ``key``."""
    path = os.path.join(directory, f"printed-{hashlib.sha1(key.encode()).hexdigest()[:16]}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return os.stat(path).st_mtime < _STARTED  # an earlier run's claim does not count
    except OSError:
        return True
    return True


def _external_failure_dir() -> str:
    """A directory shared by the ranks of one torchrun/SLURM job on one node."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's fresh directory for this run and attempt: <run>/attempt_<n>/<local rank>/error.json
        return str(Path(error_file).parent.parent / "lightning-mgpu-failures")
    keys = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT")
    job = "|".join(os.environ.get(k, "") for k in keys)
    return str(_failures_root() / hashlib.sha1(job.encode()).hexdigest()[:12])


def new_failure_dir() -> str:
    """A fresh directory for the records of one launch (our launchers pass it to their ranks)."""
    root = _failures_root()
    root.mkdir(exist_ok=True)
    return tempfile.mkdtemp(dir=root)


def _failures_root() -> Path:
    root = Path(tempfile.gettempdir(), f"lightning-mgpu-failures-{os.getuid()}")
    _remove_stale(root)
    return root


def _remove_stale(root: Path, age_s: float = 3600) -> None:
    """Records are read seconds after a failure: directories untouched for an hour belong to jobs long ended."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            if time.time() - entry.stat().st_mtime > age_s:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


_hook_target: tuple[int, str, Callable[[], None]] | None = None  # the failure's id, error line, and its printer
_sigterm_before: Any = None  # the SIGTERM handler `_say_then_end` replaced, until `restore_sigterm` puts it back


def _install_excepthook(exception: BaseException, handle: Callable[[], None]) -> None:
    """Run ``handle`` instead of the usual printing if ``exception`` ends the process; leave others alone.

    One hook per process, aimed at the latest failure (by id and error line: exceptions cannot be weakly referenced,
    and holding this one would keep its frames alive after a caller caught it); it puts the previous hook back when
    it fires.
    """
    global _hook_target
    _hook_target = (id(exception), error_line(exception), handle)
    if getattr(sys.excepthook, "__name__", "") == "_lightning_mgpu_excepthook":
        return
    previous = sys.excepthook

    def _lightning_mgpu_excepthook(exc_type: type, value: BaseException, tb: object) -> None:
        global _hook_target
        target = _hook_target
        if target is None or id(value) != target[0] or error_line(value) != target[1]:
            return previous(exc_type, value, tb)  # type: ignore[arg-type]
        sys.excepthook = previous
        _hook_target = None  # a SIGTERM arriving while this prints (`_say_then_end`) must not print it again
        target[2]()

    sys.excepthook = _lightning_mgpu_excepthook
