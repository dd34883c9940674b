"""Elastic restart (``examples/elastic/``): a node lost mid-epoch does not end the run.

Two simulated nodes of 2 processes under torchrun's elastic agent (``--nnodes=1:2 --max-restarts=3``, c10d
rendezvous on localhost) train the demo GPT at dp 4 with ZeRO-1 (or pp 2 x dp 2) with ``global_batch_size=16``
(4 samples per data-parallel rank), checkpointing every 4 steps. One rank of node B stalls in step 6 (the others
wait for it in that step's collectives) and the test then SIGKILLs every process of node B: a node gone. Node A's
ranks fail, its agent restarts them on the one node left (dp 2, or pp 2 x dp 1; accumulation 2), they resume from
``last.ckpt`` (step 4), and the run finishes its 12 steps. Every optimizer step is then compared with one
uninterrupted process taking batches of 16: the same samples (ids of the rows) and the same loss (1e-5 relative);
no process of the job is left.
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

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, EVERY, STALL_AT = 12, 4, 6
MARKER = "LIGHTNING_MGPU_ELASTIC_NODE"
TIMEOUT = 300

# The example's script, with a stall on node B: the test kills the node while the job waits for it.
SCRIPT = f"""
import os, sys, time
import lightning as L
sys.path.insert(0, {str(REPO / "examples" / "elastic")!r})
from train import main

class StallOnNodeB(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if os.environ["{MARKER}"].endswith("B") and trainer.global_step == {STALL_AT} and trainer.global_rank == 2:
            open(os.path.join(os.environ["FLAG_DIR"], "stalled"), "w").close()
            time.sleep(600)

main(extra_callbacks=(StallOnNodeB(),))
"""


def _records(directory: Path) -> dict[int, list[dict]]:
    """Per optimizer step, the micro-batches of the latest attempt that ran it (a restart repeats the steps after
    its checkpoint)."""
    by_attempt: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in directory.glob("rank*-attempt*.jsonl"):
        attempt = int(path.stem.split("attempt")[1])
        for line in path.read_text().splitlines():
            record = json.loads(line)
            record["attempt"] = attempt
            by_attempt[attempt][record["step"]].append(record)
    steps: dict[int, list[dict]] = {}
    for attempt in sorted(by_attempt):
        steps.update(by_attempt[attempt])
    return steps


def _processes(marker: str) -> list[int]:
    return processes_with(MARKER, marker)


def _kill(marker: str) -> None:
    for pid in _processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize(
    ("layout", "dp_before", "dp_after"),
    [([], 4, 2), (["--pp", "2"], 2, 1)],
    ids=["dp4-zero1-to-dp2", "pp2-dp2-to-pp2-dp1"],
)
def test_a_node_lost_mid_epoch_resumes_on_the_node_left_with_the_same_samples_and_losses(
    tmp_path, layout, dp_before, dp_after
):
    common = ["--accelerator", "cpu", "--max-steps", str(STEPS), "--global-batch-size", "16", "--timeout", "60"]
    # The reference: one process, batches of 16.
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "elastic" / "train.py"), *common, "--batch-size", "16"]
        + ["--every-n-steps", "100", "--record-dir", str(reference_dir), "--checkpoint-dir", str(tmp_path / "rc")],
        env=clean_env(),
        check=True,
        timeout=TIMEOUT,
        capture_output=True,
    )
    reference = _records(reference_dir)

    (tmp_path / "train.py").write_text(SCRIPT)
    records = tmp_path / "records"
    records.mkdir()
    job = f"job-{os.getpid()}-{time.time_ns()}"
    port = free_port()

    def start(node: str, is_host: bool) -> subprocess.Popen:
        command = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d"]
        command += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}", "--monitor-interval=0.5"]
        command += [
            f"--rdzv-conf=is_host={str(is_host).lower()},keep_alive_interval=1,keep_alive_max_attempt=3,"
            "last_call_timeout=5,join_timeout=120"
        ]
        command += ["train.py", *common, *layout, "--batch-size", "4", "--every-n-steps", str(EVERY)]
        command += ["--record-dir", str(records), "--checkpoint-dir", str(tmp_path / "checkpoints")]
        env = clean_env(**{MARKER: f"{job}-{node}"}, FLAG_DIR=str(tmp_path))
        del env["MASTER_PORT"]  # the rendezvous endpoint says where the nodes meet
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as examples/elastic/torchrun.sh: a fresh store per round
        log = open(tmp_path / f"node{node}.log", "w")
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)

    node_a = start("A", True)
    time.sleep(1)  # node A hosts the rendezvous store; B joins within its last call (both in the first round)
    node_b = start("B", False)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "stalled").exists():
            assert time.monotonic() < deadline, (tmp_path / "nodeA.log").read_text()[-5000:]
            assert node_a.poll() is None, (tmp_path / "nodeA.log").read_text()[-5000:]
            time.sleep(0.2)
        killed_at = time.time()
        _kill(f"{job}-B")
        node_a.wait(timeout=TIMEOUT)
    finally:
        _kill(f"{job}-A")
        _kill(f"{job}-B")
        node_b.wait(timeout=30)
    log = (tmp_path / "nodeA.log").read_text()
    assert node_a.returncode == 0, log[-6000:]

    steps = _records(records)
    assert sorted(steps) == sorted(reference) == list(range(STEPS))
    resumed_from = min(s for s, batch in steps.items() if batch[0]["attempt"] > 0)
    assert resumed_from == STALL_AT // EVERY * EVERY, resumed_from  # the last complete checkpoint
    first_after = min(r["attempt"] for r in steps[resumed_from])
    for step in range(STEPS):
        batch = steps[step]
        world = {r["world"] for r in batch}
        assert world == ({4} if step < resumed_from else {2}), (step, world)
        # One record per data-parallel rank and micro-batch: 16 samples in batches of 4 on every world.
        assert len(batch) == 4, (step, len(batch))
        ranks = {r["rank"] for r in batch}
        assert len(ranks) == (dp_before if step < resumed_from else dp_after), (step, ranks)
        ids = sorted(i for r in batch for i in r["ids"])
        assert ids == sorted(reference[step][0]["ids"]), f"step {step}: other samples than the reference's"
        loss = sum(r["loss"] for r in batch) / len(batch)
        assert loss == pytest.approx(reference[step][0]["loss"], rel=1e-5), step
    # The time from the fault (node B gone) to the first step after the restart.
    first_record = min(p.stat().st_mtime for p in records.glob(f"rank*-attempt{first_after}.jsonl"))
    print(f"\nnode B killed; the job's first step on the node left came {first_record - killed_at:.1f} s later")
    assert not _processes(f"{job}-A") and not _processes(f"{job}-B"), "processes of the job were left running"


def test_restarts_that_would_share_torchruns_store_are_warned_about(monkeypatch):
    from lightning_mgpu.launch.elastic import restart_problem, warn_about_restarts

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_problem()
    with pytest.warns(UserWarning, match=r"--max-restarts=3.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        warn_about_restarts(0)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert restart_problem() is None  # no restart: nothing to share
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert restart_problem() is None  # a fresh store per round
