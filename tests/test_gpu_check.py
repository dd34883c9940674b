"""``python -m benchmarks.gpu_check`` runs everywhere: on CPU every part says there is no CUDA device and it exits
0; the CUDA tests it runs on a GPU are collected here too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.processes import REPO


@pytest.mark.slow  # the slow tier: end to end: the GPU check's command, as a fresh process
def test_gpu_check_on_cpu_reports_no_cuda_for_every_part_and_exits_0(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--help"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    assert "--out" in help_text
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(report[part] == "no CUDA device" for part in "abcde"), report
    assert "no CUDA device" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow  # the slow tier: collects the whole suite in a fresh process
def test_at_least_five_cuda_tests_are_collected():
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-n", "0", "tests/test_cuda.py"], cwd=REPO, capture_output=True, text=True, check=False
    )
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(collected) >= 5, done.stdout[-2000:]
