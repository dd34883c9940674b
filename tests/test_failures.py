"""A failing rank ends the whole job, promptly, with its rank and error named first, and leaves no process behind.

Each case runs a small training script as a user would (``python train.py``, the fork launcher, torchrun, an
external launch as under SLURM) with two CPU processes, makes one rank SIGKILL itself or raise, and checks the exit
code, the first lines of stderr, that the failing rank's traceback appears once, the time from the failure to the
end of the job, and that no process of the job is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lightning_mgpu.launch.failures import FailureRecord, coordinates, format_report, is_secondary
from tests.helpers.distributed import free_port
from tests.helpers.processes import LAUNCH_VARIABLES, processes_with

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="finds the job's processes in /proc; children follow their launcher through Linux's PR_SET_PDEATHSIG",
)

DEADLINE_S = 120  # for a whole run; a hang fails here instead of blocking the suite
MAX_EXIT_S = 20  # from the failure to the end of the job
MARKER = "LIGHTNING_MGPU_FAILURE_TEST"

SCRIPT = """
import os, signal, time
from datetime import timedelta
import lightning as L, torch
from lightning.pytorch.loggers import CSVLogger
from lightning_mgpu import HybridStrategy

FAIL_RANK, MODE = os.environ["FAIL_RANK"], os.environ["FAIL_MODE"]

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 0 and os.environ.get("RANK_0_BUSY"):
            time.sleep(4)  # in Python, not in a collective, when rank 1 fails and torchrun stops this rank
        if batch_idx == 2 and FAIL_RANK in ("all", str(self.global_rank)):
            with open(f"failed_at_{self.global_rank}", "w") as f:
                f.write(repr(time.time()))
            if MODE == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # stopped, not failed: no collective of the others fails
            raise ValueError("boom")
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

# Rank 0's logger takes seconds to finish after a failure (a flush, an upload): its launcher may stop it meanwhile.
class SlowToFinish(CSVLogger):
    def finalize(self, status):
        super().finalize(status)
        if status == "failed" and os.environ.get("RANK") == "0":
            time.sleep(3)

if __name__ == "__main__":
    if MODE == "absent" and os.environ.get("RANK") == FAIL_RANK:  # this rank never reaches the process group
        with open(f"failed_at_{FAIL_RANK}", "w") as f:
            f.write(repr(time.time()))
        time.sleep(120)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("DEVICES", 2)), max_steps=6,
        logger=SlowToFinish(".") if os.environ.get("SLOW_FINISH") else False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=HybridStrategy(
            start_method=os.environ["START"], timeout=timedelta(seconds=60),
            heartbeat_timeout=float(os.environ.get("HEARTBEAT", 60)),
            init_timeout=float(os.environ.get("INIT_TIMEOUT", 600)),
        ),
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4))
    if trainer.global_rank == 1 and os.environ.get("RANK_1_WORKS_AFTER_FIT"):
        time.sleep(3)
        open("rank_1_finished", "w").close()
"""

# What srun (or any scheduler) does: start every rank itself with the rendezvous variables set.
START_RANKS = """
import os, subprocess, sys
procs = []
for rank in range(2):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    procs.append(subprocess.Popen([sys.executable, "train.py"], env=env))
sys.exit(max(abs(p.wait()) for p in procs))
"""

# A launcher's variables (shared list) and the failure directory of an enclosing run: each test starts its own.
_LAUNCH_VARIABLES = (*LAUNCH_VARIABLES, "LIGHTNING_MGPU_FAILURE_DIR")


class Run:
    def __init__(self, returncode: int, stderr: str, stdout: str, exit_after_failure_s: float) -> None:
        self.returncode, self.stderr, self.stdout = returncode, stderr, stdout
        self.exit_after_failure_s = exit_after_failure_s

    def report_lines(self) -> list[str]:
        """stderr from our report or the first traceback on, whichever comes first (warnings and logs before it)."""
        lines = self.stderr.splitlines()
        start = next(
            (i for i, line in enumerate(lines) if line.startswith("lightning-mgpu:") or "Traceback" in line), len(lines)
        )
        return lines[start:]


def _job_processes(marker: str) -> list[int]:
    """Processes whose environment carries the marker: the job's, however they were started."""
    return processes_with(MARKER, marker)


def _run(tmp_path: Path, command: list[str], kill_main_at_failure: bool = False, **env: str) -> Run:
    (tmp_path / "train.py").write_text(SCRIPT)
    marker = uuid.uuid4().hex
    environment = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    environment.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{MARKER: marker}, **env)
    with open(tmp_path / "stderr", "w") as err, open(tmp_path / "stdout", "w") as out:
        proc = subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the job did not end within {DEADLINE_S} s:\n{(tmp_path / 'stderr').read_text()[-5000:]}")
    ended = time.time()
    deadline = time.monotonic() + 10  # children killed with their launcher take a moment to be reaped
    while (left := _job_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    gone = time.time()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job were left running: {left}"
    failed_at = [float(p.read_text()) for p in tmp_path.glob("failed_at_*")]
    assert failed_at or env["FAIL_RANK"] == "none", "no rank failed:\n" + (tmp_path / "stderr").read_text()[-5000:]
    failed = min(failed_at, default=ended)
    run = Run(proc.returncode, (tmp_path / "stderr").read_text(), (tmp_path / "stdout").read_text(), ended - failed)
    print(
        f"\n{command[1:3]} {env}: exit code {proc.returncode} {ended - failed:.1f} s after the failure,"
        f" last process gone after {gone - failed:.1f} s"
    )
    return run


def _assert_reported(run: Run, first_line: str, traceback_once: bool = True) -> None:
    report = run.report_lines()
    context = "\n".join(report[:40])
    assert run.returncode != 0
    assert run.exit_after_failure_s < MAX_EXIT_S, f"ended {run.exit_after_failure_s:.1f} s after the failure"
    assert report and first_line in report[0], f"expected {first_line!r} first in:\n{context}"
    # No survivor's gloo traceback (Lightning's SIGTERM notifier broadcasting inside the signal handler printed one
    # when torchrun's SIGTERM met a dead rank: `quiet_sigterm_notifier`); the failing rank's traceback once.
    assert "Connection reset by peer" not in run.stderr and "Connection closed by peer" not in run.stderr, context
    assert run.stderr.count('raise ValueError("boom")') == (1 if traceback_once else 0), context


# ------------------------------------------------------------------------------------- python train.py (popen)
@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_script_launcher_worker_killed(tmp_path):
    run = _run(tmp_path, [sys.executable, "train.py"], START="popen", FAIL_RANK="1", FAIL_MODE="kill")
    _assert_reported(run, "rank 1 of 2 (pp 0, dp 1, tp 0) was killed by SIGKILL", traceback_once=False)
    assert "Traceback" not in run.stderr


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_script_launcher_worker_raises(tmp_path):
    run = _run(tmp_path, [sys.executable, "train.py"], START="popen", FAIL_RANK="1", FAIL_MODE="raise")
    _assert_reported(run, "rank 1 of 2 (pp 0, dp 1, tp 0) failed: ValueError: boom")
    assert run.stderr.count("Traceback") == 1


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_a_stopped_rank_is_named_and_the_job_ended_by_the_heartbeat(tmp_path):
    # SIGSTOP: rank 1 fails nothing, rank 0 would wait in its collective for the 60 s timeout; the heartbeat (3 s)
    # names rank 1 and ends the job, whose stopped child dies with its parent.
    run = _run(tmp_path, [sys.executable, "train.py"], START="popen", FAIL_RANK="1", FAIL_MODE="stop", HEARTBEAT="3")
    assert run.returncode != 0
    assert "rank 1 of 2 (pp 0, dp 1, tp 0) stopped responding: no heartbeat for" in run.stderr, run.stderr[-3000:]
    assert run.exit_after_failure_s < 10, f"ended {run.exit_after_failure_s:.1f} s after the stop"


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_script_launcher_every_rank_raises_the_same_error(tmp_path):
    run = _run(tmp_path, [sys.executable, "train.py"], START="popen", FAIL_RANK="all", FAIL_MODE="raise")
    _assert_reported(run, "all 2 ranks failed: ValueError: boom")


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_script_launcher_main_process_killed_leaves_no_orphan(tmp_path):
    # Rank 0 is the process the user started: its children die with it (no report is possible from a SIGKILL).
    run = _run(tmp_path, [sys.executable, "train.py"], START="popen", FAIL_RANK="0", FAIL_MODE="kill")
    assert run.returncode == -signal.SIGKILL
    assert run.exit_after_failure_s < MAX_EXIT_S


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_script_launcher_lets_its_children_finish(tmp_path):
    # Children die with the main process, so it waits for them at exit: a rank's work after `fit` is not cut short.
    run = _run(
        tmp_path,
        [sys.executable, "train.py"],
        START="popen",
        FAIL_RANK="none",
        FAIL_MODE="-",
        RANK_1_WORKS_AFTER_FIT="1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "rank_1_finished").exists()
    assert "lightning-mgpu:" not in run.stderr


# ------------------------------------------------------------------------------------------------ fork launcher
@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_fork_launcher_worker_raises(tmp_path):
    run = _run(tmp_path, [sys.executable, "train.py"], START="fork", FAIL_RANK="1", FAIL_MODE="raise")
    _assert_reported(run, "rank 1 of 2 (pp 0, dp 1, tp 0) failed: ValueError: boom")
    # Then the parent's RankFailedError, one line of message, ends the script (a notebook cell shows it).
    assert "RankFailedError: lightning-mgpu: rank 1 of 2" in run.report_lines()[-1]


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_fork_launcher_worker_killed(tmp_path):
    run = _run(tmp_path, [sys.executable, "train.py"], START="fork", FAIL_RANK="1", FAIL_MODE="kill")
    _assert_reported(run, "rank 1 of 2 (pp 0, dp 1, tp 0) was killed by SIGKILL", traceback_once=False)


# ------------------------------------------------------------------------------- torchrun, SLURM-style external
@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_torchrun_worker_raises(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "train.py",
    ]
    # The survivor is slow to finish after the failure, so torchrun's SIGTERM (sent as soon as rank 1 has exited)
    # usually reaches it before it has said why it stopped: it must say so all the same.
    run = _run(tmp_path, command, START="auto", FAIL_RANK="1", FAIL_MODE="raise", SLOW_FINISH="1")
    _assert_reported(run, "rank 1 of 2 (pp 0, dp 1, tp 0) failed: ValueError: boom")
    # The survivor says in one line why it stopped; torchrun's summary names rank 1 with our traceback (the once).
    assert "lightning-mgpu: rank 0 of 2 (pp 0, dp 0, tp 0) stopped: rank 1 failed: ValueError: boom" in run.stderr
    summary = run.stderr[run.stderr.index("Root Cause") :]
    assert "rank      : 1" in summary and summary.count('raise ValueError("boom")') == 1
    assert "Connection reset by peer" not in run.stderr and "Connection closed by peer" not in run.stderr


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_torchrun_stops_a_rank_between_collectives(tmp_path):
    # torchrun's SIGTERM reaches rank 0 in its own Python code, before any collective of it could fail: Lightning
    # ends it with a SystemExit (SIGTERMException), which no excepthook sees; it still says why it stopped.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), "train.py"]
    run = _run(tmp_path, command, START="auto", FAIL_RANK="1", FAIL_MODE="raise", RANK_0_BUSY="1")
    _assert_reported(run, "rank 1 of 2 (pp 0, dp 1, tp 0) failed: ValueError: boom")
    assert "lightning-mgpu: rank 0 of 2 (pp 0, dp 0, tp 0) stopped: rank 1 failed: ValueError: boom" in run.stderr


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_torchrun_a_rank_that_never_arrives_ends_the_job_within_init_timeout(tmp_path):
    """Rank 2 of 3 never reaches the process group: ranks 0 and 1 wait in its initialization until their bound
    (``init_timeout=4``), and each says so in one line (the first to end makes torchrun SIGTERM the other, which
    is inside gloo's C++ then and says it all the same)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3"]
    command += ["--master_port", str(free_port()), "train.py"]
    run = _run(tmp_path, command, START="auto", FAIL_RANK="2", FAIL_MODE="absent", DEVICES="3", INIT_TIMEOUT="4")
    assert run.returncode != 0 and run.exit_after_failure_s < MAX_EXIT_S, run.stderr[-3000:]
    for rank in (0, 1):
        lines = [line for line in run.stderr.splitlines() if line.startswith(f"lightning-mgpu: rank {rank} of 3 ")]
        assert len(lines) == 1, run.stderr[-3000:]
        assert "process-group initialization" in lines[0], lines
    expired = "still in process-group initialization after 4 s (init_timeout=4 s): a rank of this round has not"
    assert expired in run.stderr, run.stderr[-3000:]


@pytest.mark.slow  # the slow tier: end to end: a launcher's failure handling, with real processes
def test_external_launch_worker_raises(tmp_path):
    """As under SLURM: every rank started from outside with the rendezvous variables, and no torchrun."""
    (tmp_path / "start_ranks.py").write_text(START_RANKS)
    command = [sys.executable, "start_ranks.py"]
    run = _run(tmp_path, command, START="auto", FAIL_RANK="1", FAIL_MODE="raise", PORT=str(free_port()))
    _assert_reported(run, "rank 1 of 2 (pp 0, dp 1, tp 0) failed: ValueError: boom")
    assert "lightning-mgpu: rank 0 of 2 (pp 0, dp 0, tp 0) stopped: rank 1 failed: ValueError: boom" in run.stderr
    assert run.stderr.count("Traceback") == 1


# ------------------------------------------------------------------------------------------------------ pieces
def test_report_names_the_cause_first_and_its_traceback_once():
    def record(rank, error, secondary, t):
        return FailureRecord(rank, error, f"Traceback ...\n{error}\n", secondary, t)

    records = {
        0: record(0, "RuntimeError: Connection closed by peer", True, 2.0),
        3: record(3, "ValueError: x", False, 1.0),
    }
    headline, report = format_report(
        4, records, {1: 0, 2: None, 3: 1}, lambda r: f"pp 0, dp {r // 2}, tp {r % 2}", frozenset({2})
    )
    assert headline == "lightning-mgpu: rank 3 of 4 (pp 0, dp 1, tp 1) failed: ValueError: x"
    assert report.splitlines()[1] == (
        "lightning-mgpu: the job ended; the other ranks: 0 (lost its peers), 1 (stopped), 2 (stopped)"
    )
    assert report.count("Traceback") == 1 and "Connection closed" not in report.split("\n", 2)[2]
    # A death without a record is a cause, named with its signal.
    _, report = format_report(2, {0: records[0]}, {1: -9}, str)
    assert report.startswith("lightning-mgpu: rank 1 of 2 (1) was killed by SIGKILL (exit code -9)")
    # Ctrl-C reaches every rank: no rank is blamed.
    interrupted = {1: record(1, "KeyboardInterrupt", True, 1.0)}
    assert format_report(2, interrupted, {1: 1}, str)[1] == "lightning-mgpu: interrupted (KeyboardInterrupt)"
    # Only echoes (the others timed out): the rank that had to be stopped is named first.
    headline, _ = format_report(2, {0: records[0]}, {1: -9}, str, frozenset({1}))
    assert headline.startswith("lightning-mgpu: rank 1 of 2 (1) stopped responding and had to be stopped")


def test_coordinates_follow_the_pp_dp_tp_mesh():
    assert coordinates(3, (1, 2, 2)) == "pp 0, dp 1, tp 1"
    assert coordinates(5, (2, 2, 2)) == "pp 1, dp 0, tp 1"
    assert coordinates(1, (2, 1, 1)) == "pp 1, dp 0, tp 0"


def test_communication_errors_are_echoes():
    import torch.distributed as dist

    assert is_secondary(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    assert is_secondary(dist.DistBackendError("NCCL communicator was aborted"))
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError:
            raise KeyError("while handling")  # noqa: B904 - the implicit chain (__context__) is what is tested
    except KeyError as chained:
        assert is_secondary(chained)
    assert not is_secondary(ValueError("boom"))


def test_a_failures_sigterm_handler_is_put_back_at_teardown(tmp_path, monkeypatch):
    """A failure replaces SIGTERM's handler (a launcher's SIGTERM then prints this rank's line first); teardown puts
    back the one it replaced, also when the fit failed before Lightning registered (and so restores) its own."""
    from lightning_mgpu.launch import failures

    monkeypatch.setenv(failures.FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the failure installs its own; put back after the test
    monkeypatch.setattr(failures, "_hook_target", None)

    def users_handler(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, users_handler)
    try:
        failures.handle_rank_failure(RuntimeError("boom"), 0, 2, (1, 2, 1))
        assert signal.getsignal(signal.SIGTERM) is failures._say_then_end
        failures.handle_rank_failure(RuntimeError("again"), 0, 2, (1, 2, 1))  # a second failure keeps the user's
        failures.restore_sigterm()
        assert signal.getsignal(signal.SIGTERM) is users_handler
        failures.restore_sigterm()  # nothing of ours left: a no-op
        assert signal.getsignal(signal.SIGTERM) is users_handler
    finally:
        signal.signal(signal.SIGTERM, before)
