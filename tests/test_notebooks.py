"""The workflow notebooks in examples/ run top to bottom in a Jupyter kernel, and what they show holds.

Each notebook also asserts its own results in its cells (a failing assertion fails the test with the cell's
traceback); the tests below check the printed outputs on top. The committed notebooks carry their outputs, so they
read well on GitHub: re-save them after a change with the command in docs/guides/notebooks.md. Each test forks 2-8
CPU processes from the kernel; 45-85 s apiece on two CPU cores shared with other work.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.notebooks import execute, text_outputs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SAVED_WITH_OUTPUTS = (
    "notebook_finetune_hf.ipynb",
    "notebook_pretrained.ipynb",
    "notebook_checkpoints_across_layouts.ipynb",
    "notebook_choosing_a_layout.ipynb",
)
SAVED_WITHOUT_OUTPUTS = ("notebook_hybrid_strategy.ipynb",)  # run by tests/test_examples.py


def test_every_notebook_is_run_by_a_test():
    assert sorted(p.name for p in EXAMPLES.glob("*.ipynb")) == sorted(SAVED_WITH_OUTPUTS + SAVED_WITHOUT_OUTPUTS)


@pytest.mark.parametrize("name", SAVED_WITH_OUTPUTS)
def test_workflow_notebooks_are_saved_executed_without_errors(name):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    nbformat.validate(nb)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code_cells] == list(range(1, len(code_cells) + 1)), name
    assert not [o for cell in code_cells for o in cell.outputs if o.output_type == "error"], name


@pytest.mark.slow  # the slow tier: end to end: the notebook executed in a fresh kernel
def test_finetune_hf_notebook(tmp_path):
    """pp 2 x tp 2 with ZeRO-1 (dp 2), bf16-mixed -> consolidate --format safetensors -> from_pretrained -> generate."""
    nb, seconds = execute(EXAMPLES / "notebook_finetune_hf.ipynb", tmp_path)
    out = text_outputs(nb)
    print(f"notebook_finetune_hf.ipynb: {seconds:.0f} s")
    assert "dp=2 x tp=2 x pp=2 (zero_stage=1)" in out and "Starting with 8 processes" in out
    assert "`max_steps=30` reached" in out
    assert re.search(r"model\.safetensors \(39 tensors, prefix 'model\.' stripped; wrote config\.json", out), out
    exported, workers = map(float, re.search(r"exported model: ([\d.]+) \(workers, bf16-mixed: ([\d.]+)", out).groups())
    assert exported == pytest.approx(workers, abs=0.05) and exported < 5.8  # trained: ln(512) = 6.24 untrained
    generated = out[out.rindex("Shall I compare thee") :]
    assert len(generated.strip()) > len("Shall I compare thee") + 20, generated  # the generate cell wrote text


@pytest.mark.slow  # the slow tier: end to end: the notebook executed in a fresh kernel
def test_pretrained_notebook(tmp_path):
    """A sharded Llama checkpoint read into pp 2 x tp 2 (each rank a quarter of the model), fine-tuned, written
    back by every rank as a Hugging Face checkpoint, loaded with from_pretrained: the loss fell."""
    nb, seconds = execute(EXAMPLES / "notebook_pretrained.ipynb", tmp_path)
    out = text_outputs(nb)
    print(f"notebook_pretrained.ipynb: {seconds:.0f} s")
    assert "(Hugging Face): 39 model entries from the checkpoint ('' -> 'model.')" in out
    assert out.count("holds 0.66 MB of the model's 2.63 MB") == 4
    before, after = map(float, re.search(r"pretrained ([\d.]+), fine-tuned and exported ([\d.]+)", out).groups())
    assert after < before - 1.0


@pytest.mark.slow  # the slow tier: end to end: the notebook executed in a fresh kernel
def test_checkpoints_across_layouts_notebook(tmp_path):
    """tp 2 -> resume under dp 4 ZeRO-3: the losses continue the uninterrupted run's; inspect; consolidate."""
    nb, seconds = execute(EXAMPLES / "notebook_checkpoints_across_layouts.ipynb", tmp_path)
    out = text_outputs(nb)
    print(f"notebook_checkpoints_across_layouts.ipynb: {seconds:.0f} s")
    assert "dp=1 x tp=2 x pp=1 (zero_stage=0), 2 processes" in out and "global step 10" in out  # inspect
    assert "dp=4 x tp=1 x pp=1 (zero_stage=3)" in out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, flags=re.M)
    assert [int(step) for step, _, _ in rows] == list(range(11, 21)), rows
    for _, uninterrupted, resumed in rows:
        assert float(resumed) == pytest.approx(float(uninterrupted), rel=1e-5)
    assert float(re.search(r"largest relative difference: (\S+)", out).group(1)) < 1e-5
    assert "consolidated weights equal the weights returned to the notebook: True" in out


@pytest.mark.slow  # the slow tier: end to end: the notebook executed in a fresh kernel
def test_choosing_a_layout_notebook(tmp_path):
    """Six layouts measured on 4 processes, a plot, and the planner's table for 7B on 64 H100s."""
    nb, seconds = execute(EXAMPLES / "notebook_choosing_a_layout.ipynb", tmp_path)
    out = text_outputs(nb)
    print(f"notebook_choosing_a_layout.ipynb: {seconds:.0f} s")
    rows = re.findall(
        r"^\s*(\S.*?)\s+(dp=\d x tp=\d x pp=\d \(zero_stage=\d\))\s+(\d+)\s+(\d+)\s+"
        r"([\d.]+(?: +[\d.]+){3})",
        out,
        flags=re.M,
    )
    assert len(rows) == 6, out
    state = {name: [float(mb) for mb in per_rank.split()] for name, _, _, _, per_rank in rows}
    assert all(len(mbs) == 4 for mbs in state.values())
    assert max(state["dp4 zero3"]) < 0.3 * min(state["dp4"])  # measured: sharded states are a quarter
    assert any("image/png" in o.get("data", {}) for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "64 x h100-sxm" in out and "Why:" in out  # the planner's table
