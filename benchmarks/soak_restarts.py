"""Restart soak: one elastic torchrun job on two simulated nodes taken through a sequence of faults, each recovered.

    python -m benchmarks.soak_restarts                              # the 13 faults below, then 10 refusal cycles
    python -m benchmarks.soak_restarts --faults kill-node:B,join:B --shared-cycles 0

Two torchrun agents on this machine (``--nnodes=1:2 --nproc-per-node=2``, c10d rendezvous on 127.0.0.1, node A
hosting it) run ``examples/elastic/train.py`` (the demo GPT, dp 4 or dp 2, ZeRO-1, ``global_batch_size=16``,
checkpoints every 4 steps) through ``benchmarks/soak_worker.py``, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
as ``examples/elastic/torchrun.sh`` sets it. The soak activates one fault at a time; the rank it names fires it
between two checkpoints (or inside a save or a load) and stalls there, the soak then does the damage:

=================  ======================================================================================
``kill-worker``    SIGKILL of one worker
``stop-worker``    SIGSTOP of one worker: the heartbeat (``heartbeat_timeout=5``) ends the rank watching it
``stall-loader``   a worker stuck in ``time.sleep`` inside the data loader's ``__getitem__``: the others'
                   collectives time out (``timeout=20``)
``kill-node``      SIGKILL of node B's agent and workers: the job goes on as dp 2 on node A
``join``           node B started again: torchrun restarts node A's ranks with B's, dp 4
``kill-in-save``   SIGKILL of node B while its rank writes ``last.ckpt`` (the previous one must stay loadable)
``kill-in-load``   SIGKILL of a worker while it reads the checkpoint after a restart (the soak causes that
                   restart first by killing a worker of node A)
=================  ======================================================================================

After each fault it waits for the job's first optimizer step after it (the recovery time) and counts the steps run
again (the last step before the fault back to the checkpoint the job resumed from). At the end every step's samples
and loss are compared with one uninterrupted process's (batches of 16, the same samples in the same order), and so
are the final weights, within a few times what an uninterrupted dp-4 job run next to it differs by. Then, under
torchrun's default store (``TORCHELASTIC_USE_AGENT_STORE=True``), ``--shared-cycles`` jobs are started with
restarts and each must be refused by every rank with the message naming the variable, within the bound, before any
step. No run needs a human: every wait has a deadline, and every
process of a job is killed at its end (the job's processes carry a marker in their environment).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.helpers.processes import REPO, clean_env, processes_with

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
MARKER = "LIGHTNING_MGPU_SOAK_RUN"
EVERY = 4  # checkpoint interval in optimizer steps
GLOBAL_BATCH = 16
KINDS = {
    "kill-worker": "SIGKILL of one worker",
    "stop-worker": "SIGSTOP of one worker (the heartbeat ends it)",
    "stall-loader": "a worker stuck in time.sleep inside the data loader",
    "kill-node": "SIGKILL of node B's agent and workers",
    "join": "node B rejoining the running job",
    "kill-in-save": "SIGKILL of node B while it writes last.ckpt",
    "kill-in-load": "SIGKILL of a worker during the checkpoint load after a restart",
}
SCHEDULE = (
    "kill-worker:B1",
    "stop-worker:A1",
    "stall-loader:B0",
    "kill-node:B0",
    "join:B",
    "kill-in-save:B0",
    "join:B",
    "kill-in-load:B1",
    "stop-worker:B0",
    "kill-worker:A0",
    "stall-loader:A1",
    "kill-node:B1",
    "join:B",
)
# torchrun's c10d rendezvous, tuned for seconds-long rounds on one machine (the defaults wait 30 s per last call).
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5,join_timeout=120"
FAULT_DEADLINE_S = 180  # from activating a fault to its firing, and from the fault to the next step
END_DEADLINE_S = 600
MAX_STEPS = 100_000  # the job ends when the soak says so (``stop.json``), this many steps ahead of its last one:
STOP_AHEAD = 4


class SoakError(RuntimeError):
    """The job did not recover, ended wrongly or trained other weights than one process: the logs' tails follow."""


@dataclass(frozen=True)
class Settings:
    heartbeat_timeout: float = 5.0
    timeout: float = 20.0  # collectives: a rank stuck outside them is found when its peers' time out
    init_timeout: float = 90.0
    max_restarts: int = 30
    # The final weights may differ from one process's by this many times what an uninterrupted dp-4 job's differ
    # (run side by side): the order of the reductions differs between one process and data parallelism, and
    # parameters whose gradient is rounding noise (the attention's key bias: softmax ignores a shift of every key
    # score) are moved by Adam by full-size steps of it, so the weights drift apart while the losses agree.
    control_factor: float = 3.0
    weights_atol: float = 1e-5  # the floor: below it any drift passes


@dataclass
class Outcome:
    """One fault: what, when, how long until the next optimizer step, and the steps the job ran again."""

    index: int
    spec: str
    fault_time: float = 0.0
    recovery_s: float = 0.0
    steps_recomputed: int = 0
    resumed_at_step: int = -1
    world_after: int = 0
    fired_where: str = ""

    @property
    def kind(self) -> str:
        return self.spec.split(":")[0]


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    max_weight_difference: float = float("nan")
    control_weight_difference: float = float("nan")  # an uninterrupted dp-4 job's, against the same process
    steps: int = 0
    refusals_s: list[float] = field(default_factory=list)
    refusal_hangs: int = 0


# --------------------------------------------------------------------------------------------------------- a job
def _example_args(directory: Path, max_steps: int, settings: Settings, batch_size: int) -> list[str]:
    args = ["--accelerator", "cpu", "--max-steps", str(max_steps), "--global-batch-size", str(GLOBAL_BATCH)]
    args += ["--batch-size", str(batch_size), "--timeout", str(settings.timeout)]
    args += ["--heartbeat-timeout", str(settings.heartbeat_timeout), "--init-timeout", str(settings.init_timeout)]
    return [*args, "--checkpoint-dir", str(directory / "checkpoints"), "--record-dir", str(directory / "records")]


def _worker(directory: Path, every: int) -> list[str]:
    return ["-m", "benchmarks.soak_worker", "--soak-dir", str(directory), "--every-n-steps", str(every)]


class Job:
    """The two simulated nodes of one torchrun job and the soak's files (``soak_worker``'s side of them)."""

    def __init__(self, directory: Path, max_steps: int, settings: Settings, shared_store: bool = False) -> None:
        self.directory, self.settings, self.shared_store = directory, settings, shared_store
        (directory / "records").mkdir(parents=True, exist_ok=True)
        self.run_id = f"soak-{os.getpid()}-{time.time_ns()}"
        self.port = int(clean_env()["MASTER_PORT"])  # a free port outside the ephemeral range
        self.arguments = _example_args(directory, max_steps, settings, batch_size=GLOBAL_BATCH // 4)
        self.agents: dict[str, subprocess.Popen] = {}
        self.started: dict[str, int] = defaultdict(int)

    def start(self, node: str, max_restarts: int | None = None) -> None:
        restarts = self.settings.max_restarts if max_restarts is None else max_restarts
        command = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=2", f"--max-restarts={restarts}"]
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run_id}"]
        command += ["--monitor-interval=0.5", f"--rdzv-conf=is_host={str(node == 'A').lower()},{RDZV_CONF}"]
        command += [*_worker(self.directory, EVERY), *self.arguments]
        env = clean_env(**{MARKER: f"{self.run_id}-{node}"}, SOAK_NODE=node)
        del env["MASTER_PORT"]  # the rendezvous endpoint says where the nodes meet
        if not self.shared_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # the documented setting (examples/elastic/torchrun.sh)
        else:
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default: one store for every round
        self.started[node] += 1
        log = open(self.log_path(node), "w")
        self.agents[node] = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log_path(self, node: str) -> Path:
        return self.directory / f"node{node}-{self.started[node]}.log"

    def processes(self, node: str) -> list[int]:
        return processes_with(MARKER, f"{self.run_id}-{node}")

    def kill_node(self, node: str) -> None:
        """The agent and every worker of ``node`` (workers run in sessions of their own: each is found by its mark)."""
        for pid in self.processes(node):
            _signal(pid, signal.SIGKILL)
        agent = self.agents.pop(node, None)
        if agent is not None:
            agent.wait(timeout=30)

    def kill_all(self) -> None:
        for node in ("A", "B"):
            self.kill_node(node)

    def running(self, node: str) -> bool:
        agent = self.agents.get(node)
        return agent is not None and agent.poll() is None

    # ------------------------------------------------------------------------------------------- the soak's files
    def activate(self, fault: dict[str, Any]) -> None:
        tmp = self.directory / "active.json.tmp"
        tmp.write_text(json.dumps(fault))
        os.replace(tmp, self.directory / "active.json")

    def deactivate(self) -> None:
        self.activate({})

    def fired(self, index: int) -> dict[str, Any] | None:
        try:
            return json.loads((self.directory / f"fired-{index}.json").read_text())
        except (OSError, ValueError):  # not yet, or being written
            return None

    def steps(self) -> list[dict[str, Any]]:
        path = self.directory / "steps.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def logs(self, tail: int | None = 4000) -> str:
        paths = sorted(self.directory.glob("node*.log"))
        return "\n".join(f"--- {path.name}:\n{path.read_text()[-(tail or 0) :]}" for path in paths)

    def fail(self, message: str) -> SoakError:
        return SoakError(f"{message}\n{self.logs()}")


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _wait(job: Job, what: str, ready: Callable[[], Any], deadline_s: float = FAULT_DEADLINE_S) -> Any:
    """Poll ``ready()`` until it returns something; the job's failure (node A's agent gone) or the deadline fail."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        if not job.running("A"):
            raise job.fail(f"node A's agent ended (code {job.agents['A'].returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise job.fail(f"no {what} within {deadline_s:.0f} s")


# ------------------------------------------------------------------------------------------------------- faults
def _parse(spec: str) -> tuple[str, str, int | None]:
    kind, _, where = spec.partition(":")
    if kind not in KINDS or not where or where[0] not in "AB":
        raise ValueError(f"fault {spec!r}: expected KIND:NODE[LOCAL_RANK], KIND one of {', '.join(KINDS)}")
    return kind, where[0], int(where[1:]) if where[1:] else None


def _inject(job: Job, index: int, spec: str) -> Outcome:
    """Fire one fault and wait for the job's first optimizer step after it."""
    kind, node, local_rank = _parse(spec)
    outcome = Outcome(index, spec)
    steps = job.steps()
    if kind == "join":
        if job.running("B"):
            raise job.fail(f"fault {index} ({spec}): node B is running, it cannot join")
        job.start("B")
        outcome.fault_time, outcome.fired_where = time.time(), "node B started"
    else:
        world = 4 if node == "B" or kind in ("kill-node", "kill-in-save") else None
        fault = {"id": index, "kind": kind, "node": node, "local_rank": local_rank, "world": world}
        job.activate(fault | {"from_step": steps[-1]["step"] + 2 if steps else 0})
        if kind == "kill-in-load":  # the restart whose load the fault interrupts: a worker of node A lost
            _kill_a_worker_of(job, "A")
        fired = _wait(job, f"fault {index} ({spec}) to fire", lambda: job.fired(index))
        outcome.fired_where = fired["where"]
        job.deactivate()
        if kind in ("kill-worker", "kill-in-load"):
            _signal(fired["pid"], signal.SIGKILL)
        elif kind == "stop-worker":
            _signal(fired["pid"], signal.SIGSTOP)
        elif kind in ("kill-node", "kill-in-save"):
            job.kill_node("B")
        outcome.fault_time = time.time() if kind != "stall-loader" else fired["time"]

    def first_step_after() -> dict[str, Any] | None:
        after = [s for s in job.steps() if s["time"] > outcome.fault_time and (kind != "join" or s["world"] == 4)]
        return after[0] if after else None

    first = _wait(job, f"a step after fault {index} ({spec})", first_step_after)
    outcome.recovery_s = first["time"] - outcome.fault_time
    outcome.resumed_at_step, outcome.world_after = first["step"], first["world"]
    # The round before: the steps up to the fault, or (a join) up to the restart that took the new node in.
    before = [s for s in job.steps() if s["time"] < first["time"]]
    outcome.steps_recomputed = max(0, before[-1]["step"] - first["step"] + 1) if before else 0
    return outcome


def _kill_a_worker_of(job: Job, node: str) -> None:
    workers = [pid for pid in job.processes(node) if pid != job.agents[node].pid]
    if not workers:
        raise job.fail(f"no worker of node {node} to kill")
    _signal(max(workers), signal.SIGKILL)


# ------------------------------------------------------------------------------------------ the checks at the end
def _latest_steps(directory: Path) -> dict[int, list[dict[str, Any]]]:
    """Per optimizer step, the micro-batches of the last round that ran it (a restart runs the steps after its
    checkpoint again; the rounds of one step are a restart, tens of seconds, apart)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for path in directory.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                record = json.loads(line)
                by_step[record["step"]].append(record)
    return {
        step: [r for r in records if r["time"] > max(r["time"] for r in records) - 3.0]
        for step, records in by_step.items()
    }


def _check_like_one_process(job: Job, reference: Path, control: Path, max_steps: int) -> tuple[float, float]:
    """The job's every step's samples and loss against the uninterrupted process's, and its final weights as close
    to that process's as an uninterrupted data-parallel job's are (``control``). Returns both weight differences."""
    steps, expected = _latest_steps(job.directory / "records"), _latest_steps(reference / "records")
    if sorted(steps) != list(range(max_steps)) or sorted(expected) != list(range(max_steps)):
        raise job.fail(f"steps recorded: {sorted(steps)[:5]}... (expected 0..{max_steps - 1})")
    for step in range(max_steps):
        ids = sorted(i for r in steps[step] for i in r["ids"])
        if ids != sorted(expected[step][0]["ids"]):
            raise job.fail(f"step {step}: other samples than one process's")
        loss = sum(r["loss"] for r in steps[step]) / len(steps[step])
        if abs(loss - expected[step][0]["loss"]) > 1e-5 * abs(expected[step][0]["loss"]):
            raise job.fail(f"step {step}: loss {loss} against one process's {expected[step][0]['loss']}")
    difference = _weight_difference(job.directory, reference)
    control_difference = _weight_difference(control, reference)
    bound = max(job.settings.weights_atol, job.settings.control_factor * control_difference)
    if difference > bound:
        raise job.fail(
            f"final weights differ from one process's by up to {difference:.3g}, an uninterrupted data-parallel"
            f" job's by {control_difference:.3g} (allowed: {bound:.3g})"
        )
    return difference, control_difference


def _weight_difference(directory: Path, reference: Path) -> float:
    """The largest absolute difference of the two runs' final weights (``final.pt``)."""
    final, wanted = (torch.load(d / "final.pt", weights_only=True) for d in (directory, reference))
    if final.keys() != wanted.keys():
        raise SoakError(f"the final weights of {directory} have other entries than {reference}'s")
    return max(float((final[k] - wanted[k]).abs().max()) for k in wanted)


def run_reference(directory: Path, max_steps: int, settings: Settings) -> Path:
    """One uninterrupted process, batches of the global batch size."""
    args = _example_args(directory, max_steps, settings, batch_size=GLOBAL_BATCH)
    return _run_alone(directory, [sys.executable, *_worker(directory, 1_000_000), *args], "the reference")


def run_control(directory: Path, max_steps: int, settings: Settings) -> Path:
    """The job's layout without a fault: one torchrun agent of 4 workers (dp 4), its checkpoints as the job's."""
    args = _example_args(directory, max_steps, settings, batch_size=GLOBAL_BATCH // 4)
    command = [TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=4", "--max-restarts=0"]
    return _run_alone(directory, [*command, *_worker(directory, EVERY), *args], "the uninterrupted dp-4 job")


def _run_alone(directory: Path, command: list[str], what: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "records").mkdir(exist_ok=True)
    mark = f"{directory.name}-{os.getpid()}-{time.time_ns()}"
    env = clean_env(**{MARKER: mark})
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=END_DEADLINE_S)
    except subprocess.TimeoutExpired:
        raise SoakError(f"{what} did not end within {END_DEADLINE_S} s") from None
    finally:
        for pid in processes_with(MARKER, mark):
            _signal(pid, signal.SIGKILL)
    if result.returncode != 0:
        raise SoakError(f"{what} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return directory


# ---------------------------------------------------------------------------------------------------- the soak
def run_soak(
    directory: Path, schedule: tuple[str, ...] = SCHEDULE, settings: Settings | None = None, verbose: bool = True
) -> Report:
    """The job through ``schedule``; raises :class:`SoakError` on the first fault it does not recover from."""
    settings = settings or Settings()
    for spec in schedule:
        _parse(spec)
    job = Job(directory / "job", MAX_STEPS, settings)
    report = Report()
    try:
        job.start("A")
        time.sleep(1)  # node A hosts the rendezvous; B joins within its last call (both in the first round)
        job.start("B")
        _wait(job, "the job's first step on both nodes", lambda: any(s["world"] == 4 for s in job.steps()))
        for index, spec in enumerate(schedule, start=1):
            outcome = _inject(job, index, spec)
            report.outcomes.append(outcome)
            if verbose:
                print(_outcome_line(outcome), flush=True)
        steps = _stop(job)
        reference = run_reference(directory / "reference", steps, settings)
        control = run_control(directory / "control", steps, settings)
        differences = _check_like_one_process(job, reference, control, steps)
        report.max_weight_difference, report.control_weight_difference = differences
        report.steps = steps
    finally:
        job.kill_all()
    _check_nothing_left(job)
    return report


def _stop(job: Job) -> int:
    """End the job a few steps on (every rank reads it before it gets there); the number of steps it trained."""
    stop_at = job.steps()[-1]["step"] + 1 + STOP_AHEAD
    (job.directory / "stop.json").write_text(json.dumps({"at": stop_at}))
    for node in list(job.agents):
        try:
            job.agents[node].wait(timeout=END_DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise job.fail(f"node {node}'s agent did not end within {END_DEADLINE_S} s") from None
        if job.agents[node].returncode != 0:
            raise job.fail(f"node {node}'s agent ended with code {job.agents[node].returncode}")
    return stop_at


def _check_nothing_left(job: Job) -> None:
    deadline = time.monotonic() + 10  # killed processes take a moment to go
    while (left := job.processes("A") + job.processes("B")) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise SoakError(f"processes of the job were left: {left}")


def run_refusals(directory: Path, cycles: int, settings: Settings | None = None, deadline_s: float = 180) -> Report:
    """``cycles`` jobs under torchrun's default store with restarts: each must be refused by every rank, naming
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, before any step, and end by itself within ``deadline_s``."""
    settings = settings or Settings()
    report = Report()
    for cycle in range(cycles):
        job = Job(directory / f"shared-{cycle}", 8, settings, shared_store=True)
        started = time.monotonic()
        try:
            job.start("A", max_restarts=1)
            time.sleep(1)
            job.start("B", max_restarts=1)
            for node, agent in job.agents.items():
                try:
                    agent.wait(timeout=max(1.0, deadline_s - (time.monotonic() - started)))
                except subprocess.TimeoutExpired:
                    report.refusal_hangs += 1
                    raise job.fail(
                        f"cycle {cycle}: node {node}'s agent still running after {deadline_s:.0f} s"
                    ) from None
            ended = time.monotonic() - started
            if (
                job.steps()
                or any(agent.returncode == 0 for agent in job.agents.values())
                or not _every_rank_refused(job)
            ):
                raise job.fail(f"cycle {cycle}: expected every rank of a round to refuse, no step, failed agents")
            report.refusals_s.append(ended)
        finally:
            job.kill_all()
        _check_nothing_left(job)
    return report


def _every_rank_refused(job: Job) -> bool:
    """Every rank of some round printed the refusal (a round of both nodes: 4 ranks; of one: 2)."""
    # Each rank refuses by itself; the ranks whose refusal came after another's say so ("stopped: another rank
    # failed or stopped (ElasticStoreError: ...)"), still naming the refusal.
    refusal = r"(?:failed: |\()ElasticStoreError: torchrun may restart"
    pattern = re.compile(r"lightning-mgpu: rank (\d+) of (\d+) .*" + refusal)
    ranks: dict[int, set[int]] = defaultdict(set)
    for match in pattern.finditer(job.logs(tail=None)):
        ranks[int(match[2])].add(int(match[1]))
    return any(found == set(range(world)) for world, found in ranks.items())


# ------------------------------------------------------------------------------------------------------- report
def _outcome_line(outcome: Outcome) -> str:
    return (
        f"{outcome.index:>2} {outcome.spec:<16} {KINDS[outcome.kind]:<62} {outcome.recovery_s:>6.1f} s"
        f" {outcome.steps_recomputed:>3} steps again (resumed at step {outcome.resumed_at_step},"
        f" world {outcome.world_after})"
    )


def _spread(values: list[float]) -> str:
    return f"min {min(values):.1f} / median {statistics.median(values):.1f} / max {max(values):.1f}"


def summary(report: Report) -> str:
    lines = []
    if report.outcomes:
        lines.append("fault                                                                   recovery  recomputed")
        lines += [_outcome_line(o) for o in report.outcomes]
        recovery = [o.recovery_s for o in report.outcomes]
        recomputed = [float(o.steps_recomputed) for o in report.outcomes]
        lines.append(f"recovery (fault -> first optimizer step after it), s: {_spread(recovery)}")
        lines.append(f"steps recomputed per fault: {_spread(recomputed)}, {sum(recomputed):.0f} in all")
        by_kind: dict[str, list[Outcome]] = defaultdict(list)
        for outcome in report.outcomes:
            by_kind[outcome.kind].append(outcome)
        for kind, outcomes in by_kind.items():
            seconds = ", ".join(f"{o.recovery_s:.1f}" for o in outcomes)
            again = ", ".join(str(o.steps_recomputed) for o in outcomes)
            lines.append(f"  {kind:<13} recovery {seconds} s; steps recomputed {again}")
        lines.append(
            f"final weights: max |difference| from one uninterrupted process {report.max_weight_difference:.2g}"
            f" (an uninterrupted dp-4 job's: {report.control_weight_difference:.2g});"
            f" all {report.steps} steps took one process's samples, with its losses (1e-5 relative)"
        )
    if report.refusals_s:
        lines.append(
            f"torchrun's default store: {len(report.refusals_s)} of {len(report.refusals_s)} jobs refused by every"
            f" rank before any step, ended in {_spread(report.refusals_s)} s; {report.refusal_hangs} hangs"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(SCHEDULE), help="KIND:NODE[LOCAL_RANK],... in order")
    parser.add_argument("--shared-cycles", type=int, default=10, help="refusal cycles on torchrun's default store")
    parser.add_argument("--dir", type=Path, default=None, help="where the jobs write (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes there")
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="lightning-mgpu-soak-"))
    print(f"soak in {directory}", flush=True)
    schedule = tuple(spec for spec in args.faults.split(",") if spec)
    report = run_soak(directory, schedule) if schedule else Report()
    refusals = run_refusals(directory, args.shared_cycles)
    report.refusals_s, report.refusal_hangs = refusals.refusals_s, refusals.refusal_hangs
    print(summary(report), flush=True)
    if args.json is not None:
        data = asdict(report) | {"outcomes": [asdict(o) for o in report.outcomes]}
        args.json.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
