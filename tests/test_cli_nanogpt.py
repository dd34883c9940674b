"""The Lightning CLI example with Karpathy's nanoGPT as published, under data parallel 2 x tensor parallel 2.

The example's model file must stay the published code: it is checked against the tests' copy (the one the
equivalence tests train against one process), then the CLI is run as a user runs it, with four processes.
"""

from __future__ import annotations

import ast
import csv
import math
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import run

pytestmark = pytest.mark.slow  # the slow tier: end to end: the nanoGPT example's command, as fresh processes


REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path("examples") / "cli" / "train_nanogpt.py"
CONFIG = Path("examples") / "cli" / "nanogpt_tp.yaml"
TIMEOUT = 300


def _definitions(path: Path) -> dict[str, str]:
    """Source of each top-level class of a file, docstrings included."""
    tree = ast.parse(path.read_text())
    return {node.name: ast.unparse(node) for node in tree.body if isinstance(node, ast.ClassDef)}


def test_the_example_model_is_the_published_nanogpt():
    example = _definitions(REPO / "examples" / "cli" / "nanogpt_model.py")
    published = _definitions(REPO / "tests" / "helpers" / "nanogpt.py")
    published.pop("NanoGPTModule")  # the tests' Lightning wrapper, not part of model.py
    assert example == published


def test_cli_trains_nanogpt_under_dp2_tp2(tmp_path):
    steps = 20
    cmd = [
        sys.executable,
        str(SCRIPT),
        "fit",
        "--config",
        str(CONFIG),
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.max_steps={steps}",
        "--trainer.strategy.init_args.start_method=fork",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={tmp_path}",
    ]
    try:
        result = run(cmd, timeout=TIMEOUT)
    except TimeoutError as error:
        pytest.fail(str(error))
    tail = result.stdout[-5000:]
    assert result.returncode == 0, f"exit code {result.returncode}. Output:\n{tail}"
    assert "Starting with 4 processes" in result.stdout, tail
    assert f"`max_steps={steps}` reached" in result.stdout, tail
    (metrics,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    with metrics.open() as file:
        losses = [float(row["train_loss"]) for row in csv.DictReader(file) if row.get("train_loss")]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses), losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses  # byte-level text: ln(256) = 5.5 at the start
