"""``python -m benchmarks.gpu_check`` runs everywhere: on CPU every part says there is no CUDA device and it exits
0; its help lists every part; its CUDA-free dry run goes through parts f and g on CPU tensors; part h's layouts
run on gloo processes with the bytes of their analytic minimum; the CUDA tests it runs on a GPU are collected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_layouts
from tests.helpers.distributed import run_distributed
from tests.helpers.processes import REPO

NEW_PARTS = ("f. Context-parallel attention", "g. The optimizer step on CUDA DTensor shards", "h. With 2 GPUs")


def test_help_lists_every_part(capsys):
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for part in "abcdefgh":
        assert f"\n{part}. " in text, part
    assert all(line in text for line in NEW_PARTS), text
    assert "--parts" in text and "--cpu-dry-run" in text


def test_without_cuda_every_part_reports_no_cuda_and_the_report_names_the_versions(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(report[part] == "no CUDA device" for part in "abcdefgh"), report
    assert report["environment"]["device"] == "no CUDA device" and report["environment"]["torch"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "- **h**: no CUDA device" in markdown and "- **torch**:" in markdown
    assert gpu_check.main(["--out", str(tmp_path), "--parts", "fh"]) == 0
    assert set(json.loads((tmp_path / "gpu_check.json").read_text())) == {"started", "environment", "f", "h", "seconds"}
    with pytest.raises(SystemExit):
        gpu_check.main(["--parts", "fz"])


def _dry_run(out: str) -> dict:
    assert gpu_check.main(["--cpu-dry-run", "--cp-seq", "128", "--g-steps", "3", "--out", out]) == 0
    return json.loads((Path(out) / "gpu_check.json").read_text())


def test_the_cpu_dry_run_goes_through_parts_f_and_g(tmp_path):
    """Parts f and g's code on CPU tensors (the fused CPU kernel; CPU DTensors): what a first GPU run would hit."""
    (report,) = run_distributed(_dry_run, 1, str(tmp_path))
    assert set(report) == {"started", "environment", "f", "g", "seconds"}, report
    chosen = report["f"]["chosen"]
    assert chosen["kernel"] == "flash_cpu" and chosen["within_bf16"], chosen
    assert all("skipped" in report["f"][kernel] for kernel in ("flash", "efficient", "cudnn"))
    assert report["g"]["same_result"] and report["g"]["max_abs_difference"] <= 1e-6, report["g"]


@pytest.mark.slow  # the slow tier: end to end: the GPU check's command, as a fresh process
def test_gpu_check_on_cpu_reports_no_cuda_for_every_part_and_exits_0(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--help"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    assert "--out" in help_text and all(line in help_text for line in NEW_PARTS)
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(report[part] == "no CUDA device" for part in "abcdefgh"), report
    assert "no CUDA device" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow  # the slow tier: each layout's ranks as fresh processes under torchrun
@pytest.mark.parametrize("layout", ["dp2-zero3", "tp2", "pp2", "cp2"])
def test_part_h_layouts_on_gloo_send_their_analytic_bytes_and_train_like_one_process(tmp_path, layout):
    """Part h's worker on CPU processes (``--accelerator cpu``): every rank sends its layout's analytic minimum (but
    the logged loss's few bytes), and every step's loss is within 1e-4 of one process."""
    outputs = {}
    for name in ("one", layout):
        processes = gpu_layouts.LAYOUTS[name][0]
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] * (processes > 1)
        worker = ["-m", "benchmarks.gpu_layouts", "--layout", name, "--accelerator", "cpu", "--steps", "5"]
        done = subprocess.run([sys.executable, *launcher, *worker, "--out", str(tmp_path / name)], cwd=REPO,
                              capture_output=True, text=True, check=False, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[name] = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(processes)]
    for rank in outputs[layout]:
        assert rank["analytic_bytes"] <= rank["bytes"] <= rank["analytic_bytes"] + 64, rank
        assert rank["unknown_work_items"] == []
        assert rank["losses"] == pytest.approx(outputs["one"][0]["losses"], rel=1e-4)
        if layout == "cp2":  # the ring's sends, counted as batch_isend_irecv issues them (NCCL's stand-in)
            assert rank["batched_sends"] == rank["by_kind"]["SEND"] > 0


@pytest.mark.slow  # the slow tier: collects the whole suite in a fresh process
def test_at_least_five_cuda_tests_are_collected():
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-n", "0", "tests/test_cuda.py"], cwd=REPO, capture_output=True, text=True, check=False
    )
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(collected) >= 5, done.stdout[-2000:]
