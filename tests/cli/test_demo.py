import os
import re
import shutil
import subprocess
import sys

import pytest

from lightning_mgpu import __version__
from lightning_mgpu.cli import main


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lightning-mgpu {__version__}"


def test_help_lists_commands(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


@pytest.mark.slow  # the slow tier: a user's command as a fresh process (8 ranks, 80 steps: ~90 s of 2 busy cores)
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
    # The progress bar counts real epochs (Lightning prints max_epochs=-1 as "Epoch 1/-2"), and Lightning's own
    # torch-2.13 deprecation note is not repeated by every process.
    assert not re.search(r"Epoch \d+/-\d", out.stdout + out.stderr), out.stdout[-2000:]
    assert "LeafSpec" not in out.stdout + out.stderr


def test_demo_epochs_cover_max_steps():
    from lightning_mgpu.cli.demo import epochs_for as _epochs_for

    assert _epochs_for(80, 689, 16) == 2  # 44 steps an epoch, the last batch ragged
    assert _epochs_for(44, 689, 16) == 1
    assert _epochs_for(45, 689, 16) == 2
    assert _epochs_for(5, 3, 16) == 5  # one (ragged) step an epoch
