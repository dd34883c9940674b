import os
import re
import shutil
import subprocess
import sys

import pytest

from lightning_mgpu import __version__
from lightning_mgpu.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-mgpu {__version__}"


def test_help_lists_commands(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_the_readme_demo_command_as_written():
    """`lightning-mgpu demo` with its defaults (8 processes, pp2 x dp2 x tp2, ZeRO-1, whole epochs with a ragged last
    batch): it must finish, and train."""
    command = shutil.which("lightning-mgpu", path=os.path.dirname(sys.executable)) or shutil.which("lightning-mgpu")
    assert command, "the `lightning-mgpu` console script is not installed (pip install -e .)"
    out = subprocess.run([command, "demo"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp=2 x tp=2 x pp=2 (zero_stage=1) on 8 cpu processes" in out.stdout
    final = dict(re.findall(r"final (\w+): ([0-9.]+)", out.stdout))
    assert float(final["train_loss"]) < 3.0 and float(final["val_loss"]) < 3.0, out.stdout[
        -2000:
    ]  # ln(256) = 5.5 at start
    assert "sample:" in out.stdout
    assert "Traceback" not in out.stderr
