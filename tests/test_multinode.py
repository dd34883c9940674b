"""examples/multinode/: the torchrun script run as two simulated nodes on this machine, and the SLURM script's shape.

Two ``torchrun --nnodes 2 --nproc_per_node 2 --node_rank {0,1} --master_addr 127.0.0.1`` (through
``examples/multinode/torchrun.sh``) start together; the four ranks train the demo GPT under
``Trainer(devices=2, num_nodes=2, strategy=HybridStrategy(tensor_parallel_size=2, pipeline_parallel_size=2))``.
Each rank writes its node, mesh coordinate and group ranks to a JSON file. About 20-30 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.equivalence import LOSS_RTOL, fit
from tests.helpers.processes import REPO, clean_env, run_together

MULTINODE = REPO / "examples" / "multinode"
TORCHRUN = shutil.which("torchrun", path=str(Path(__import__("sys").executable).parent)) or shutil.which("torchrun")
NODES, DEVICES, MAX_STEPS = 2, 2, 5
TIMEOUT = 240


def _example_module():
    spec = importlib.util.spec_from_file_location("multinode_train", MULTINODE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed")
    report_dir = tmp_path_factory.mktemp("multinode")
    port = str(free_port())
    args = ["--accelerator", "cpu", "--tp", "2", "--pp", "2", "--max-steps", str(MAX_STEPS), "--timeout", "120",
            "--report-dir", str(report_dir)]
    command = ["bash", str(MULTINODE / "torchrun.sh"), *args]
    envs = [
        clean_env(NNODES=str(NODES), NPROC_PER_NODE=str(DEVICES), NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=port, TORCHRUN=TORCHRUN)
        for node in range(NODES)
    ]
    results = run_together([command, command], timeout=TIMEOUT, envs=envs)
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node} exited with {result.returncode}:\n{result.stdout[-5000:]}"
    reports = [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in range(NODES * DEVICES)]
    return results, reports


def test_two_simulated_nodes_keep_tensor_parallel_groups_inside_a_node(two_node_run):
    results, reports = two_node_run
    assert "Starting with 4 processes" in results[0].stdout
    node_of = {r["global_rank"]: r["node_rank"] for r in reports}
    assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}  # node-major ranks, as torchrun's --node_rank gives them
    for report in reports:
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


def test_two_simulated_nodes_train_like_one_process(two_node_run):
    _, reports = two_node_run
    example = _example_module()
    reference, _ = fit(example.build_module, example.build_datamodule, devices=1, max_steps=MAX_STEPS,
                       seed=example.SEED)
    assert len(reference.losses) == MAX_STEPS
    for report in reports:  # logged on every rank, the single-process values
        assert report["losses"] == pytest.approx(reference.losses, rel=LOSS_RTOL, abs=0.0), report["global_rank"]


def test_slurm_script_runs_the_same_training_script():
    """No SLURM here: the sbatch script parses, asks for whole nodes and starts train.py with one task per device."""
    script = (MULTINODE / "slurm.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(MULTINODE / "slurm.sbatch")]).returncode == 0
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, flags=re.M))
    assert directives["nodes"] and directives["ntasks-per-node"]
    assert re.search(r"^srun .*train\.py", script, flags=re.M | re.S)
    for variable in ("MASTER_PORT", "OMP_NUM_THREADS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert variable in script
