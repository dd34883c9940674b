"""Elastic restart (``examples/elastic/``): a node lost mid-epoch does not end the run.

Two simulated nodes of 2 processes under torchrun's elastic agent (``--nnodes=1:2 --max-restarts=3``, c10d
rendezvous on localhost) train the demo GPT at dp 4 with ZeRO-1 (or tp 2 x dp 2, pp 2 x dp 2) with
``global_batch_size=16`` (4 samples per data-parallel rank), checkpointing every 4 steps. One rank of node B stalls
in step 6 (the others wait for it in that step's collectives) and the test then SIGKILLs every process of node B (a
node gone) or SIGSTOPs them (a node frozen: the heartbeat finds it). Node A's ranks fail, its agent restarts them
on the one node left (dp 2, tp 2 x dp 1 or pp 2 x dp 1; accumulation 2), they resume from ``last.ckpt`` (step 4),
and the run finishes its 12 steps. The other direction keeps tp 2 while a joining node doubles dp. Every optimizer
step is then compared with one uninterrupted process taking batches of 16: the same samples (ids of the rows) and
the same loss (1e-5 relative); no process of the job is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.processes import REPO, clean_env, processes_with

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the job's processes in /proc")
# End to end (torchrun's elastic agents restarting real processes): the slow tier; the store check is a unit test.
end_to_end = pytest.mark.slow

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, EVERY, STALL_AT = 12, 4, 6
MARKER = "LIGHTNING_MGPU_ELASTIC_NODE"
TIMEOUT = 300

# The example's script, with a stall: local rank 0 of node STALL_NODE waits in step 6 while the world has
# STALL_WORLD ranks (the others wait for it in that step's collectives), until the test has lost or added a node.
SCRIPT = f"""
import os, sys, time
import lightning as L
sys.path.insert(0, {str(REPO / "examples" / "elastic")!r})
from train import main

class Stall(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        here = os.environ["{MARKER}"].endswith(os.environ["STALL_NODE"]) and os.environ["LOCAL_RANK"] == "0"
        if here and trainer.global_step == {STALL_AT} and trainer.world_size == int(os.environ["STALL_WORLD"]):
            open(os.path.join(os.environ["FLAG_DIR"], "stalled"), "w").close()
            time.sleep(600)

main(extra_callbacks=(Stall(),))
"""


def _records(directory: Path) -> dict[int, list[dict]]:
    """Per optimizer step, the micro-batches of the latest restart that ran it (a restart repeats the steps after
    its checkpoint). A file per process; the processes of one restart start within seconds of each other, restarts
    tens of seconds apart."""
    runs = []
    for path in directory.glob("rank*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if records:
            runs.append((min(r["time"] for r in records), records))
    restarts: list[tuple[float, dict[int, list[dict]]]] = []
    for start, records in sorted(runs, key=lambda run: run[0]):
        if not restarts or start - restarts[-1][0] > 5:
            restarts.append((start, defaultdict(list)))
        for record in records:
            restarts[-1][1][record["step"]].append(record)
    steps: dict[int, list[dict]] = {}
    for _, by_step in restarts:
        steps.update(by_step)
    return steps


def _signal(marker: str, number: int) -> None:
    for pid in processes_with(MARKER, marker):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


COMMON = ["--accelerator", "cpu", "--max-steps", str(STEPS), "--global-batch-size", "16", "--timeout", "60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, list[dict]]:
    """One process, batches of 16 (the same for every test here)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    directory = tmp_path / "records"
    directory.mkdir()
    command = [sys.executable, str(REPO / "examples" / "elastic" / "train.py"), *COMMON, "--batch-size", "16"]
    command += ["--every-n-steps", "100", "--record-dir", str(directory), "--checkpoint-dir", str(tmp_path / "ck")]
    subprocess.run(command, env=clean_env(), check=True, timeout=TIMEOUT, capture_output=True)
    return _records(directory)


class _Job:
    """Simulated nodes of one torchrun elastic job (c10d rendezvous on localhost, node A hosting it)."""

    def __init__(self, tmp_path: Path, arguments: list[str], stall_node: str, stall_world: int) -> None:
        self.tmp_path, self.arguments = tmp_path, arguments
        self.stall = {"STALL_NODE": stall_node, "STALL_WORLD": str(stall_world)}
        self.job = f"job-{os.getpid()}-{time.time_ns()}"
        self.port = free_port()
        self.nodes: dict[str, subprocess.Popen] = {}
        (tmp_path / "train.py").write_text(SCRIPT)

    def start(self, node: str) -> None:
        host = node == "A"
        command = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d"]
        command += [f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.job}", "--monitor-interval=0.5"]
        command += [
            f"--rdzv-conf=is_host={str(host).lower()},keep_alive_interval=1,keep_alive_max_attempt=3,"
            "last_call_timeout=5,join_timeout=120"
        ]
        command += ["train.py", *self.arguments]
        env = clean_env(**{MARKER: f"{self.job}-{node}"}, FLAG_DIR=str(self.tmp_path), **self.stall)
        del env["MASTER_PORT"]  # the rendezvous endpoint says where the nodes meet
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as examples/elastic/torchrun.sh: a fresh store per round
        log = open(self.tmp_path / f"node{node}.log", "w")
        self.nodes[node] = subprocess.Popen(command, cwd=self.tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_for_the_stall(self) -> float:
        deadline = time.monotonic() + TIMEOUT
        while not (self.tmp_path / "stalled").exists():
            assert time.monotonic() < deadline, self.log("A")
            assert self.nodes["A"].poll() is None, self.log("A")
            time.sleep(0.2)
        return time.time()

    def signal(self, node: str, number: int = signal.SIGKILL) -> None:
        """Every process of ``node`` (its agent and workers): SIGKILL a node gone, SIGSTOP a node frozen."""
        _signal(f"{self.job}-{node}", number)

    def log(self, node: str) -> str:
        return (self.tmp_path / f"node{node}.log").read_text()[-6000:]

    def finish(self, still_frozen: tuple[str, ...] = ()) -> None:
        """Wait for the nodes still running (a frozen node is then killed); no process of the job may be left."""
        try:
            for node, process in self.nodes.items():
                if node not in still_frozen:
                    process.wait(timeout=TIMEOUT)
        finally:
            for node in ("A", "B"):
                self.signal(node)
            for node in still_frozen:
                self.nodes[node].wait(timeout=30)
        for node in ("A", "B"):
            assert not processes_with(MARKER, f"{self.job}-{node}"), "processes of the job were left running"


def _assert_like_one_process(records: Path, reference: dict, worlds: tuple[int, int], dps: tuple[int, int]) -> float:
    """Every step's samples and loss are the reference's; steps before the restart ran on ``worlds[0]`` ranks with
    ``dps[0]`` data-parallel ranks, the others on ``worlds[1]`` / ``dps[1]``. Returns when the first step after the
    restart was recorded."""
    steps = _records(records)
    assert sorted(steps) == sorted(reference) == list(range(STEPS))
    resumed_from = min(s for s, batch in steps.items() if batch[0]["world"] == worlds[1])
    assert resumed_from == STALL_AT // EVERY * EVERY, resumed_from  # the last complete checkpoint
    for step in range(STEPS):
        batch = steps[step]
        after = step >= resumed_from
        assert {r["world"] for r in batch} == {worlds[after]}, step
        # One record per data-parallel rank and micro-batch: 16 samples in batches of 4 on every world.
        assert len(batch) == 4 and len({r["rank"] for r in batch}) == dps[after], (step, batch)
        ids = sorted(i for r in batch for i in r["ids"])
        assert ids == sorted(reference[step][0]["ids"]), f"step {step}: other samples than the reference's"
        loss = sum(r["loss"] for r in batch) / len(batch)
        assert loss == pytest.approx(reference[step][0]["loss"], rel=1e-5), step
    return min(r["time"] for r in steps[resumed_from])


def _arguments(tmp_path: Path, layout: list[str]) -> list[str]:
    records = tmp_path / "records"
    records.mkdir()
    job = [*COMMON, *layout, "--batch-size", "4", "--every-n-steps", str(EVERY), "--record-dir", str(records)]
    return [*job, "--checkpoint-dir", str(tmp_path / "checkpoints")]


@pytest.mark.parametrize(
    ("layout", "dps", "loss"),
    [
        ([], (4, 2), signal.SIGKILL),
        (["--tp", "2"], (2, 1), signal.SIGKILL),
        (["--pp", "2", "--heartbeat-timeout", "5"], (2, 1), signal.SIGSTOP),
    ],
    ids=["dp4-zero1-to-dp2-killed", "tp2-dp2-to-tp2-dp1-killed", "pp2-dp2-to-pp2-dp1-frozen"],
)
@end_to_end
def test_a_node_lost_mid_epoch_resumes_on_the_node_left_with_the_same_samples_and_losses(
    tmp_path, reference, layout, dps, loss
):
    """Node B killed (its processes gone: the peers' collectives fail at once) or frozen (SIGSTOP: its processes
    stay, silent; the heartbeat names the silent rank and ends the job, torchrun's rendezvous drops B's agent)."""
    arguments = _arguments(tmp_path, layout)
    job = _Job(tmp_path, arguments, stall_node="B", stall_world=4)
    job.start("A")
    time.sleep(1)  # node A hosts the rendezvous store; B joins within its last call (both in the first round)
    job.start("B")
    lost_at = job.wait_for_the_stall()
    job.signal("B", loss)
    if loss == signal.SIGKILL:
        job.nodes.pop("B").wait(timeout=30)
    job.finish(still_frozen=("B",) if loss == signal.SIGSTOP else ())
    assert job.nodes["A"].returncode == 0, job.log("A")
    first_step = _assert_like_one_process(tmp_path / "records", reference, worlds=(4, 2), dps=dps)
    how = "killed" if loss == signal.SIGKILL else "frozen"
    print(f"\nnode B {how}; the job's first step on the node left came {first_step - lost_at:.1f} s later")
    if loss == signal.SIGSTOP:
        assert "stopped responding" in job.log("A"), job.log("A")


@end_to_end
def test_a_node_joining_a_running_job_resumes_it_on_both_with_the_same_samples_and_losses(tmp_path, reference):
    """The other direction, with tensor parallelism kept while dp grows: node A trains alone (tp 2 x dp 1,
    accumulation 4); node B joins while A waits in step 6; torchrun restarts A's ranks with B's (tp 2 x dp 2,
    accumulation 2), from the step-4 checkpoint (the tensor-parallel shards loaded on the new mesh)."""
    arguments = _arguments(tmp_path, ["--tp", "2"])
    job = _Job(tmp_path, arguments, stall_node="A", stall_world=2)
    job.start("A")
    joined_at = job.wait_for_the_stall()
    job.start("B")
    job.finish()
    for node in "AB":
        assert job.nodes[node].returncode == 0, job.log(node)
    first_step = _assert_like_one_process(tmp_path / "records", reference, worlds=(2, 4), dps=(1, 2))
    print(f"\nnode B joined; the job's first step on both nodes came {first_step - joined_at:.1f} s later")


def test_restarts_on_torchruns_shared_store_are_refused_before_the_process_group(monkeypatch):
    from lightning_mgpu.launch.elastic import ElasticStoreError, refuse_shared_store_restarts, restart_problem

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(ElasticStoreError, match=r"--max-restarts=3.*`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`"):
        refuse_shared_store_restarts()
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # set, yet shared: torchrun's static rendezvous
    assert "the static rendezvous" in restart_problem() and "--rdzv-backend=c10d" in restart_problem()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert restart_problem() is None  # no restart: nothing to share
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert restart_problem() is None  # a fresh store per round
    refuse_shared_store_restarts()


# ------------------------------------------------------------------------------------- SLURM's requeue: slurm.sbatch
# Stand-ins for what slurm.sbatch calls: `scontrol show hostnames` names this machine; `scontrol requeue` records
# the request for the test's scheduler and, as SLURM does, ends the running job's tasks at once (SIGTERM; the test
# sends SIGKILL after KillWait); `srun` starts SLURM_NTASKS tasks with srun's variables, each marked with its node
# (the scheduler kills a node's tasks as a node failure does).
_FAKE_SCONTROL = f"""#!/usr/bin/env bash
case "$1" in
    show) echo 127.0.0.1 ;;
    requeue)
        echo "$2" >> "$FAKE_SLURM_DIR/requeued"
        for environ in /proc/[0-9]*/environ; do
            pid=${{environ#/proc/}}; pid=${{pid%/environ}}
            [[ $pid == "$$" || $pid == "$PPID" ]] && continue  # this stand-in and the shell that runs it
            if tr '\\0' '\\n' < "$environ" 2>/dev/null | grep -qx "{MARKER}=$SLURM_JOB_MARK-node[0-9]*"; then
                kill -TERM "$pid" 2>/dev/null
            fi
        done ;;
    *) echo "scontrol stand-in: '$*' is not simulated" >&2; exit 1 ;;
esac
"""
_FAKE_SRUN = f"""#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done  # srun's own options
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    node=$((i / SLURM_NTASKS_PER_NODE))
    SLURM_PROCID=$i SLURM_LOCALID=$((i % SLURM_NTASKS_PER_NODE)) SLURM_NODEID=$node \\
        {MARKER}="$SLURM_JOB_MARK-node$node" "$@" &
    pids+=($!)
done
rc=0
for pid in "${{pids[@]}}"; do wait "$pid" || rc=$?; done
exit $rc
"""
# What slurm.sbatch runs (examples/elastic/train.py, relative to the job's directory): the example with a stall,
# task STALL_TASK of the first allocation waiting STALL_S seconds after step STALL_AT.
SLURM_SCRIPT = f"""
import os, sys, time
import lightning as L
sys.path.insert(0, {str(REPO / "examples" / "elastic")!r})
from train import main

class Stall(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if first and os.environ["SLURM_PROCID"] == os.environ["STALL_TASK"] and trainer.global_step == {STALL_AT}:
            open(os.path.join(os.environ["FAKE_SLURM_DIR"], "stalled"), "w").close()
            time.sleep(float(os.environ["STALL_S"]))

main(extra_callbacks=(Stall(),))
"""


class _SlurmJob:
    """One job of examples/elastic/slurm.sbatch under the stand-ins, submitted again as SLURM requeues it."""

    def __init__(self, tmp_path: Path, stall_task: int, stall_s: float) -> None:
        self.tmp_path, self.mark = tmp_path, f"slurm-{os.getpid()}-{time.time_ns()}"
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        (tmp_path / "examples" / "elastic").mkdir(parents=True)
        (tmp_path / "examples" / "elastic" / "train.py").write_text(SLURM_SCRIPT)
        self.stall = {"STALL_TASK": str(stall_task), "STALL_S": str(stall_s)}
        self.records = tmp_path / "records"
        self.records.mkdir()
        self.submissions = 0

    def submit(self, nodes: int) -> subprocess.CompletedProcess:
        """The batch script on ``nodes`` nodes of 2 tasks, as SLURM runs it (its restart count after a requeue)."""
        env = clean_env(
            PATH=f"{self.bin}:{Path(sys.executable).parent}:{clean_env()['PATH']}",
            FAKE_SLURM_DIR=str(self.tmp_path),
            SLURM_JOB_MARK=self.mark,
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="lightning-mgpu-elastic",
            SLURM_JOB_NODELIST="127.0.0.1",
            SLURM_NODELIST="127.0.0.1",
            SLURM_NNODES=str(nodes),
            SLURM_NTASKS_PER_NODE="2",
            SLURM_NTASKS=str(2 * nodes),
            SLURM_RESTART_COUNT=str(self.submissions),
            **self.stall,
        )
        self.submissions += 1
        arguments = [*COMMON, "--batch-size", "4", "--every-n-steps", str(EVERY), "--record-dir", str(self.records)]
        log = open(self.tmp_path / f"job-{self.submissions}.log", "w")
        command = ["bash", str(REPO / "examples" / "elastic" / "slurm.sbatch"), *arguments]
        self.process = subprocess.Popen(command, cwd=self.tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self.process

    def wait_for(self, name: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not (self.tmp_path / name).exists():
            assert time.monotonic() < deadline and self.process.poll() is None, self.log()
            time.sleep(0.2)

    def signal(self, number: int, node: int | None = None) -> None:
        """SLURM's signal to the job's tasks (all, or one node's)."""
        for name in ("node0", "node1") if node is None else (f"node{node}",):
            _signal(f"{self.mark}-{name}", number)

    def end(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.signal(signal.SIGKILL)
            assert not processes_with(MARKER, f"{self.mark}-node0") + processes_with(MARKER, f"{self.mark}-node1")

    def log(self) -> str:
        return (self.tmp_path / f"job-{self.submissions}.log").read_text()[-6000:]


def _assert_steps_like_one_process(records: Path, reference: dict, worlds: tuple[int, int]) -> int:
    """Every step took the reference's samples with its loss; the first allocation's on ``worlds[0]`` ranks, the
    requeued one's on ``worlds[1]``. Returns the step the requeued job resumed at."""
    steps = _records(records)
    assert sorted(steps) == list(range(STEPS))
    resumed_from = min(s for s, batch in steps.items() if batch[0]["time"] > _requeue_time(steps))
    for step, batch in steps.items():
        assert {r["world"] for r in batch} == {worlds[step >= resumed_from]}, step
        assert sorted(i for r in batch for i in r["ids"]) == sorted(reference[step][0]["ids"]), step
        loss = sum(r["loss"] for r in batch) / len(batch)
        assert loss == pytest.approx(reference[step][0]["loss"], rel=1e-5), step
    return resumed_from


def _requeue_time(steps: dict[int, list[dict]]) -> float:
    """The largest gap between consecutive micro-batches: the requeue (the allocations are seconds apart)."""
    times = sorted(r["time"] for batch in steps.values() for r in batch)
    gaps = [(later - earlier, later) for earlier, later in zip(times, times[1:])]
    return max(gaps)[1] - 1e-6


@end_to_end
def test_a_slurm_job_requeued_after_a_node_failure_resumes_on_the_nodes_it_gets(tmp_path, reference):
    """slurm.sbatch under stand-ins for srun and scontrol: node 1's tasks are killed in step 6 (a node failure), the
    allocation ends; SLURM requeues the job (--requeue) on one node and it resumes from last.ckpt (step 4) as dp 2
    with the same global batch, every step as one process."""
    assert "#SBATCH --requeue" in (REPO / "examples" / "elastic" / "slurm.sbatch").read_text()
    job = _SlurmJob(tmp_path, stall_task=2, stall_s=600)
    job.submit(nodes=2)
    job.wait_for("stalled")
    job.signal(signal.SIGKILL, node=1)
    assert job.end() != 0, job.log()
    job.submit(nodes=1)
    assert job.end() == 0, job.log()
    resumed = _assert_steps_like_one_process(job.records, reference, worlds=(4, 2))
    assert resumed == STALL_AT // EVERY * EVERY
    assert (tmp_path / "elastic_checkpoints" / "last.ckpt").is_dir()  # the script's default directory


@end_to_end
def test_slurms_time_limit_signal_requeues_the_job_at_a_step_boundary_and_it_resumes_there(tmp_path, reference):
    """SIGUSR1 (``--signal=SIGUSR1@90``) reaches every task while task 1 stalls after step 6 and the others wait in
    step 7's collectives: Lightning's requeue handler saves a checkpoint (a collective) and runs ``scontrol requeue``.
    SLURM then ends the allocation (SIGTERM, SIGKILL after its KillWait) and runs the job again, which resumes from
    that checkpoint, not from last.ckpt's step 4."""
    job = _SlurmJob(tmp_path, stall_task=1, stall_s=3)
    job.submit(nodes=2)
    job.wait_for("stalled")
    job.signal(signal.SIGUSR1)
    job.wait_for("requeued")
    assert (tmp_path / "requeued").read_text().split() == ["4242"]
    time.sleep(5)  # SLURM's KillWait (30 s by default) after the requeue's SIGTERM
    job.signal(signal.SIGKILL)
    job.end()
    job.submit(nodes=2)
    assert job.end() == 0, job.log()
    resumed = _assert_steps_like_one_process(job.records, reference, worlds=(4, 4))
    assert resumed > STALL_AT, resumed
