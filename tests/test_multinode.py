"""examples/multinode/: the torchrun and SLURM scripts, each run as two simulated nodes on this machine.

Two ``torchrun --nnodes 2 --nproc_per_node 2 --node_rank {0,1} --master_addr 127.0.0.1`` (through
``examples/multinode/torchrun.sh``) start together; the four ranks train the demo GPT under
``Trainer(devices=2, num_nodes=2, strategy=HybridStrategy(tensor_parallel_size=2, pipeline_parallel_size=2))``.
Each rank writes its node, mesh coordinate and group ranks to a JSON file. Then ``examples/multinode/slurm.sbatch``
runs under a stand-in ``srun`` that starts the 4 tasks with SLURM's variables. About 25 s per job on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.equivalence import LOSS_RTOL, fit
from tests.helpers.processes import REPO, clean_env, run_together

pytestmark = pytest.mark.slow  # the slow tier: end to end: simulated nodes and the SLURM script, as fresh processes


MULTINODE = REPO / "examples" / "multinode"
TORCHRUN = shutil.which("torchrun", path=str(Path(__import__("sys").executable).parent)) or shutil.which("torchrun")
NODES, DEVICES, MAX_STEPS = 2, 2, 5
TIMEOUT = 240


def _example_module():
    spec = importlib.util.spec_from_file_location("multinode_train", MULTINODE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun_two_nodes(report_dir: Path, layout: list[str]) -> tuple[list, list[dict]]:
    """``torchrun.sh`` as two simulated nodes of 2 processes with ``layout``'s arguments: each node's output and
    each rank's report."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed")
    port = str(free_port())
    args = ["--accelerator", "cpu", *layout, "--max-steps", str(MAX_STEPS), "--timeout", "120"]
    command = ["bash", str(MULTINODE / "torchrun.sh"), *args, "--report-dir", str(report_dir)]
    envs = [
        clean_env(
            NNODES=str(NODES),
            NPROC_PER_NODE=str(DEVICES),
            NODE_RANK=str(node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            TORCHRUN=TORCHRUN,
        )
        for node in range(NODES)
    ]
    results = run_together([command, command], timeout=TIMEOUT, envs=envs)
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node} exited with {result.returncode}:\n{result.stdout[-5000:]}"
    reports = [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in range(NODES * DEVICES)]
    return results, reports


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    return _torchrun_two_nodes(tmp_path_factory.mktemp("multinode"), ["--tp", "2", "--pp", "2"])


@pytest.fixture(scope="module")
def reference_losses():
    example = _example_module()
    reference, _ = fit(
        example.build_module, example.build_datamodule, devices=1, max_steps=MAX_STEPS, seed=example.SEED
    )
    assert len(reference.losses) == MAX_STEPS
    return reference.losses


def test_two_simulated_nodes_keep_tensor_parallel_groups_inside_a_node(two_node_run):
    results, reports = two_node_run
    assert "Starting with 4 processes" in results[0].stdout
    node_of = {r["global_rank"]: r["node_rank"] for r in reports}
    assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}  # node-major ranks, as torchrun's --node_rank gives them
    for report in reports:
        assert report["cluster_environment"] == "TorchElasticEnvironment"
        assert report["env"]["GROUP_RANK"] == str(report["node_rank"])  # torchrun's node index reached Lightning
        assert report["mesh_dim_names"] == ["pp", "dp", "tp"] and report["mesh_shape"] == [2, 1, 2]
        tp_group = report["groups"]["tp"]
        assert {node_of[rank] for rank in tp_group} == {report["node_rank"]}, report  # tp never crosses a node
        assert len(tp_group) == 2
        pp_group = report["groups"]["pp"]
        assert {node_of[rank] for rank in pp_group} == {0, 1}, report  # the pipeline spans the nodes
        pp, dp, tp = report["coordinate"]
        assert (pp, dp) == (report["node_rank"], 0) and tp == report["local_rank"], report
    assert sorted(map(tuple, {tuple(r["groups"]["tp"]) for r in reports})) == [(0, 1), (2, 3)]


def test_two_simulated_nodes_train_like_one_process(two_node_run, reference_losses):
    _, reports = two_node_run
    for report in reports:  # logged on every rank, the single-process values
        assert report["losses"] == pytest.approx(reference_losses, rel=LOSS_RTOL, abs=0.0), report["global_rank"]


def test_hybrid_sharding_shards_inside_each_simulated_node(tmp_path, reference_losses):
    """dp 4 at ZeRO-3 with ``--shard-size 2`` (``data_parallel_shard_size``): the shard groups are the nodes, the
    replicate groups cross them, and the run (global batch 8, as the reference's) trains like one process."""
    layout = ["--zero-stage", "3", "--shard-size", "2", "--batch-size", "2"]
    _, reports = _torchrun_two_nodes(tmp_path, layout)
    node_of = {r["global_rank"]: r["node_rank"] for r in reports}
    for report in reports:
        assert report["mesh_dim_names"] == ["pp", "dp_replicate", "dp_shard", "tp"], report
        assert {node_of[rank] for rank in report["groups"]["dp_shard"]} == {report["node_rank"]}, report
        assert {node_of[rank] for rank in report["groups"]["dp_replicate"]} == {0, 1}, report
        assert report["losses"] == pytest.approx(reference_losses, rel=LOSS_RTOL, abs=0.0), report["global_rank"]
    assert {tuple(r["groups"]["dp_shard"]) for r in reports} == {(0, 1), (2, 3)}


# A stand-in for SLURM's srun: start SLURM_NTASKS copies of the command with the variables srun gives each task.
_FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done  # srun's own options
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$((i % SLURM_NTASKS_PER_NODE)) SLURM_NODEID=$((i / SLURM_NTASKS_PER_NODE)) "$@" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
_FAKE_SCONTROL = """#!/usr/bin/env bash
echo 127.0.0.1  # `scontrol show hostnames <nodelist>`: the first (only) node
"""


def test_slurm_script_runs_as_two_simulated_nodes(two_node_run, tmp_path):
    """The sbatch script itself, under a fake srun/scontrol: Lightning's SLURMEnvironment sees 2 nodes x 2 tasks."""
    _, torchrun_reports = two_node_run
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    report_dir = tmp_path / "reports"
    env = clean_env(
        PATH=f"{bin_dir}:{Path(TORCHRUN).parent}:{clean_env()['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="hybrid-tp-pp",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_NODELIST="127.0.0.1",
        SLURM_NNODES=str(NODES),
        SLURM_NTASKS_PER_NODE=str(DEVICES),
        SLURM_NTASKS=str(NODES * DEVICES),
        SLURM_CPUS_PER_TASK="1",
        MASTER_PORT=str(free_port()),
    )
    # The script's own arguments are for GPUs; later ones win (argparse), as `sbatch slurm.sbatch --tp 4` would.
    args = [
        "--accelerator",
        "cpu",
        "--precision",
        "32-true",
        "--tp",
        "2",
        "--pp",
        "2",
        "--max-steps",
        str(MAX_STEPS),
        "--timeout",
        "120",
        "--report-dir",
        str(report_dir),
    ]
    (result,) = run_together([["bash", str(MULTINODE / "slurm.sbatch"), *args]], timeout=TIMEOUT, envs=[env])
    assert result.returncode == 0, result.stdout[-5000:]
    reports = [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in range(NODES * DEVICES)]
    for report, expected in zip(reports, torchrun_reports):
        assert report["cluster_environment"] == "SLURMEnvironment"
        assert report["node_rank"] == expected["node_rank"] and report["groups"] == expected["groups"], report
        assert report["losses"] == pytest.approx(expected["losses"], rel=LOSS_RTOL, abs=0.0)
    assert {tuple(r["groups"]["tp"]) for r in reports} == {(0, 1), (2, 3)}
    script = (MULTINODE / "slurm.sbatch").read_text()
    for variable in ("MASTER_PORT", "OMP_NUM_THREADS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert variable in script
