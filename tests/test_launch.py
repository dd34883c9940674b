"""The fork launcher (notebooks, interactive Python) hands the workers' results back to the main process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import lightning as L, torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_mgpu import HybridStrategy

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    checkpoint = ModelCheckpoint(dirpath=sys.argv[1], save_last=True, monitor="loss", save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4, callbacks=[checkpoint], logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=HybridStrategy(start_method="fork"))
    trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=4))
    print("LAST", trainer.checkpoint_callback.last_model_path)
    print("BEST", trainer.checkpoint_callback.best_model_path)
    print("SCORE", float(trainer.checkpoint_callback.best_model_score))
    """
)


@pytest.mark.slow  # the slow tier: end to end: a script forking its ranks, as a fresh process
def test_forked_fit_reports_the_checkpoint_paths_in_the_main_process(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(
        line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in ("LAST", "BEST", "SCORE")
    )
    assert Path(lines["LAST"]).name == "last.ckpt" and Path(lines["LAST"]).exists(), done.stdout
    assert Path(lines["BEST"]).exists() and Path(lines["BEST"]) != Path(lines["LAST"]), done.stdout
    assert float(lines["SCORE"]) > 0


def test_free_port_is_bindable_and_outside_the_range_the_kernel_hands_out_itself():
    """A rendezvous port must not come from the ephemeral range, where gloo's listeners and outgoing connections of
    a job running beside this one get theirs (the race behind a rare EADDRINUSE under `pytest -n 2`)."""
    import socket

    from lightning_mgpu.launch.ports import _ephemeral_ports, free_port

    low, high = _ephemeral_ports()
    ports = {free_port() for _ in range(50)}
    assert all(10_000 <= port < 65_536 and not low <= port <= high for port in ports), (sorted(ports), low, high)
    assert len(ports) > 40  # drawn at random, not a fixed sequence both xdist workers would share
    with socket.socket() as sock:
        sock.bind(("", ports.pop()))  # free when returned
