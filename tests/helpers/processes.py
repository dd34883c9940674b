"""Run example commands as a user would (subprocesses), with a deadline and no orphans.

Every command starts in a session of its own, so that on a timeout or a failure the whole process group (the
command, the workers Lightning's launcher or torchrun started, their children) is killed, not just the parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_mgpu.launch import free_port

REPO = Path(__file__).resolve().parents[2]

# Set by torchrun, SLURM-less launchers or an enclosing Lightning run: inherited, they would make the examples
# believe they were launched externally (or reuse a busy port) instead of starting their own processes.
LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


def processes_with(variable: str, value: str) -> list[int]:
    """Processes (but this one) whose environment has ``variable=value``: a job's, however they were started."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if f"{variable}={value}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launch variables (and no SLURM job), a free ``MASTER_PORT``, plus
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"  # several processes on a shared machine: no thread oversubscription
    env["PYTHONUNBUFFERED"] = "1"
    # Lightning's own pick comes from the ephemeral range, where a job beside this one may take it first.
    env["MASTER_PORT"] = str(free_port())
    env.update(extra)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_together(
    commands: Sequence[Sequence[str]],
    timeout: float,
    envs: Sequence[Mapping[str, str]] | None = None,
    cwd: Path = REPO,
) -> list[subprocess.CompletedProcess]:
    """Start ``commands`` at once and wait for all of them; each result holds stdout and stderr together.

    When one exits with an error the others are given 30 s to notice (their collectives fail) and are then
    killed; after ``timeout`` s everything still running is killed and ``TimeoutError`` lists the outputs.
    """
    envs = envs or [clean_env()] * len(commands)
    procs = [
        subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for cmd, env in zip(commands, envs)
    ]
    # Drain the pipes in threads: a command whose output fills the pipe would block otherwise.
    import threading

    outputs: list[list[str]] = [[] for _ in procs]
    readers = [
        threading.Thread(target=lambda p=p, out=out: out.extend(p.stdout), daemon=True)  # type: ignore[misc]
        for p, out in zip(procs, outputs)
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, now + 30.0)
            time.sleep(0.2)
    finally:
        for p in procs:
            _kill_group(p)  # also the workers of a command that exited: none may outlive the test
            p.wait()
        for reader in readers:
            reader.join(timeout=5)
    results = [
        subprocess.CompletedProcess(list(cmd), p.returncode, "".join(out))
        for cmd, p, out in zip(commands, procs, outputs)
    ]
    if timed_out:
        tails = "\n".join(f"--- {' '.join(r.args)} (rc {r.returncode}):\n{r.stdout[-3000:]}" for r in results)
        raise TimeoutError(f"not finished within {timeout:.0f} s, killed. Output:\n{tails}")
    return results


def run(command: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """One command, as :func:`run_together`."""
    return run_together([command], timeout, [env or clean_env()])[0]
