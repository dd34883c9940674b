"""The GPU-only paths, on one CUDA device: skipped here (no CUDA in CI), run by ``python -m benchmarks.gpu_check``
when a GPU is lent. Each compares against the same thing on CPU or against one process, as the CPU suite does."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_mgpu import HybridStrategy, ScalingMonitor
from lightning_mgpu.demo import GPTLightningModule, TextDataModule

pytestmark = pytest.mark.cuda
STEPS = 5


def _fit(
    precision: str,
    strategy: Any = None,
    callbacks: list | None = None,
    devices: int = 1,
    ckpt_path: str | None = None,
    max_steps: int = STEPS,
    **trainer: Any,
) -> L.Trainer:
    L.seed_everything(1234)
    module = GPTLightningModule(block_size=64, n_layer=2, n_head=4, n_embd=128)
    fit_trainer = L.Trainer(
        accelerator="cuda", devices=devices, strategy=strategy or HybridStrategy(), precision=precision,
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks or [], **trainer,
    )  # fmt: skip
    fit_trainer.fit(module, TextDataModule(batch_size=8 // devices, block_size=64), ckpt_path=ckpt_path)
    return fit_trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_cuda_precisions_train_like_lightnings_single_device(precision):
    """HybridStrategy at devices=1 on CUDA: the same losses as Lightning's own single-device strategy."""
    ours = _fit(precision).callback_metrics["train_loss"].item()
    theirs = _fit(precision, strategy="auto").callback_metrics["train_loss"].item()
    assert ours == pytest.approx(theirs, rel=2e-2)


def test_cuda_monitor_reads_cuda_events_and_memory(tmp_path):
    monitor = ScalingMonitor(dirpath=tmp_path, verbose=False)
    _fit("bf16-mixed", callbacks=[monitor])
    report = monitor.report
    assert report["memory"][0]["peak_kind"] == "cuda max_memory_allocated"
    assert report["throughput"]["tokens_per_s"] > 0 and 0 < report["throughput"]["mfu"] < 1


def test_cuda_tensors_checkpoint_and_resume(tmp_path):
    """Sharded (DCP) and full checkpoints of CUDA tensors, written and resumed on the GPU."""
    for fmt in ("sharded", "full"):
        whole = _fit("32-true", HybridStrategy(checkpoint_format=fmt), max_steps=2 * STEPS)
        first = _fit("32-true", HybridStrategy(checkpoint_format=fmt))
        first.save_checkpoint(tmp_path / fmt)
        resumed = _fit("32-true", HybridStrategy(checkpoint_format=fmt), ckpt_path=str(tmp_path / fmt),
                       max_steps=2 * STEPS)  # fmt: skip
        loss = resumed.callback_metrics["train_loss"].item()
        assert loss == pytest.approx(whole.callback_metrics["train_loss"].item(), rel=1e-4), fmt


def test_cuda_async_checkpoint_uses_pinned_memory(tmp_path):
    trainer = _fit("bf16-mixed", HybridStrategy(async_checkpoint=True))
    trainer.save_checkpoint(tmp_path / "async.ckpt")
    trainer.strategy.teardown()  # waits for the background save
    assert (tmp_path / "async.ckpt").exists()
    resumed = _fit("bf16-mixed", HybridStrategy(), ckpt_path=str(tmp_path / "async.ckpt"), max_steps=STEPS + 1)
    assert resumed.global_step == STEPS + 1


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="Lightning gives each process its own device: two processes need two GPUs",
)
def test_cuda_two_processes_over_gloo():
    """dp 2 over gloo on CUDA tensors (``cpu:gloo,cuda:gloo``): trains and matches one process."""
    one = _fit("32-true").callback_metrics["train_loss"].item()
    two = _fit("32-true", HybridStrategy(process_group_backend="cpu:gloo,cuda:gloo", start_method="fork"), devices=2)
    assert two.callback_metrics["train_loss"].item() == pytest.approx(one, rel=1e-4)


def test_cuda_compile_trains(tmp_path):
    compiled = _fit("bf16-mixed", HybridStrategy(compile=True)).callback_metrics["train_loss"].item()
    eager = _fit("bf16-mixed").callback_metrics["train_loss"].item()
    assert compiled == pytest.approx(eager, rel=2e-2)
