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


def test_demo_trains_with_several_processes():
    """The README's main command, shortened: a real run with forked CPU workers, progress and final loss."""
    out = subprocess.run(
        [sys.executable, "-m", "lightning_mgpu.cli", "demo", "--devices", "4", "--tensor-parallel-size", "1",
         "--max-steps", "6", "--n-layer", "2", "--n-embd", "32", "--sample-tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp=2 x tp=1 x pp=2 (zero_stage=1)" in out.stdout
    assert "final train_loss:" in out.stdout and "sample:" in out.stdout
