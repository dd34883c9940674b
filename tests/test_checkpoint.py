"""Checkpoints: exact resume (mid-epoch too), any layout to any other, full files, atomic saves, async, consolidation.

One uninterrupted run (dp=2, ZeRO-1) saves at steps 3 (mid-epoch 0), 4 (epoch boundary) and 6 (mid-epoch 1); the
resume tests load one of those under another layout (and tensor/pipeline-parallel runs of a Hugging Face Llama under
ZeRO-3) and must continue the uninterrupted run's losses. Each resumed job also saves again right after loading:
consolidating that save and the original gives identical weights and optimizer states, which checks "equal after
load" in every layout with the same code. One process per layout and job; run with ``-s`` to see the measured
differences. Smaller jobs of several fits each: resuming from every kind of save (callbacks, epoch ends, after
`fit` returned) bit for bit, checkpoints that do not fit the model, and damaged files.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu import HybridStrategy
from lightning_mgpu.checkpoint import Checkpointer, CheckpointError, consolidate, write_consolidated
from lightning_mgpu.checkpoint.resume import FastForward
from lightning_mgpu.cli import main as cli
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import _fit_worker, fit
from tests.helpers.modules import CNNModule, LlamaModule, RandomImageDataModule, RandomTokenDataModule

GLOBAL_BATCH = 8
SAMPLES = 32  # 4 steps per epoch
STEPS = 10
SAVE_AT = (3, 4, 6)
CROSS_LAYOUT_RTOL = 1e-5


class ResumeModule(CNNModule):
    """The CNN with AdamW (two param groups), a per-step LR schedule, and a loss scaled by torch, Python and NumPy
    random numbers: the same on every rank, so layouts stay comparable, and wrong unless the RNGs are restored."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        noise = float(torch.rand(())) + random.random() + float(np.random.rand())
        loss = F.cross_entropy(self(x), y) * (1.0 + 0.01 * noise)
        self.log("train_loss", loss, sync_dist=True)
        self.log("sample", float(x[0, 0, 0, 0]), reduce_fx="min", sync_dist=True)  # which data, for messages
        return loss

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() > 1]
        no_decay = [p for p in self.parameters() if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data(dp: int):
    return lambda: RandomImageDataModule(num_samples=SAMPLES, batch_size=GLOBAL_BATCH // dp)


class SaveAt(L.Callback):
    """``trainer.save_checkpoint`` after the given steps (where ModelCheckpoint saves), and once right after a
    resume (``resaved``: what this layout holds once loaded). Results: sample ids seen per step."""

    def __init__(self, directory: Path, steps=(), resave: bool = False) -> None:
        self.directory, self.steps, self.resave = directory, steps, resave
        self.results: dict[str, Any] = {"save_seconds": []}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.resave:
            trainer.save_checkpoint(self.directory / "resaved.ckpt")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.steps:
            start = time.perf_counter()
            trainer.save_checkpoint(self.directory / f"step{trainer.global_step}.ckpt")
            self.results["save_seconds"].append(time.perf_counter() - start)


_runs: dict[str, Any] = {}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """dp=2, ZeRO-1, 10 steps, saving sharded checkpoints (directories; the default is one file) at 3, 4, 6 and at
    each epoch's end (``epoch0_end.ckpt``: after step 4)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    result, _ = fit(
        ResumeModule,
        _data(2),
        {"zero_stage": 1, "checkpoint_format": "sharded"},
        2,
        STEPS,
        callbacks_factory=lambda: [SaveAt(directory, SAVE_AT), SaveAtEpochEnd(directory)],
    )
    assert len(result.losses) == STEPS
    return directory, result


def _resume(
    directory: Path,
    ckpt: Path,
    dp: int,
    strategy_kwargs: dict,
    tmp: Path,
    module=ResumeModule,
    data=None,
    steps: int = STEPS,
):
    result, _ = fit(
        module,
        data or _data(dp),
        strategy_kwargs,
        dp,
        steps,
        callbacks_factory=lambda: [SaveAt(tmp, resave=True)],
        fit_kwargs={"ckpt_path": str(ckpt)},
    )
    return result


def _assert_same_states(saved: Path, resaved: Path) -> None:
    """Weights, optimizer states and LR/param-group values equal, whatever the two layouts."""
    a, b = consolidate(saved), consolidate(resaved)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    assert a["optimizer_states"][0]["param_groups"] == b["optimizer_states"][0]["param_groups"]
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(a["state_dict"]) - 0  # every parameter has a state
    for pid in sa:
        for name in sa[pid]:
            assert torch.equal(sa[pid][name], sb[pid][name]), (pid, name)
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["global_step"] == b["global_step"]


def _losses_match(reference: list[float], resumed: list[float], step: int, rtol: float) -> None:
    expected = reference[step:]
    assert len(resumed) == len(expected), (resumed, expected)
    worst = max(abs(r - e) / abs(e) for r, e in zip(resumed, expected))
    print(f"resumed after step {step}: {len(resumed)} losses, largest relative difference {worst:.2e}")
    torch.testing.assert_close(
        torch.tensor(resumed, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
        msg=lambda m: f"{m}\nexpected={expected}\nresumed={resumed}",
    )


def test_resume_in_the_same_layout_is_bit_identical(uninterrupted, tmp_path):
    directory, reference = uninterrupted
    resumed = _resume(directory, directory / "step6.ckpt", 2, {"zero_stage": 1}, tmp_path)
    assert resumed.losses == reference.losses[6:]  # mid-epoch 1: data order, RNGs, LR schedule, optimizer
    _assert_same_states(directory / "step6.ckpt", tmp_path / "resaved.ckpt")


@pytest.mark.parametrize(
    ("step", "dp", "strategy_kwargs"),
    [
        (3, 2, {"zero_stage": 3}),  # mid-epoch 0, ZeRO-1 -> ZeRO-3
        (4, 4, {"zero_stage": 2}),  # epoch boundary, dp 2 -> 4
        (6, 1, {}),  # mid-epoch 1, onto one process
    ],
    ids=["zero1-to-zero3", "dp2-to-dp4-zero2", "dp2-to-one-process"],
)
def test_resume_in_another_layout(uninterrupted, tmp_path, step, dp, strategy_kwargs):
    directory, reference = uninterrupted
    resumed = _resume(directory, directory / f"step{step}.ckpt", dp, strategy_kwargs, tmp_path)
    _losses_match(reference.losses, resumed.losses, step, CROSS_LAYOUT_RTOL)
    _assert_same_states(directory / f"step{step}.ckpt", tmp_path / "resaved.ckpt")


def test_resume_restores_the_loss_scaler_even_before_any_optimizer_step(tmp_path):
    """fp16 with a scale that overflows: the first steps are skipped, so the step-3 checkpoint has a scaler state
    and no optimizer state at all; resuming must restore the one and create none of the other."""
    from lightning_mgpu import HybridPrecision

    plugins = lambda: {"plugins": [HybridPrecision("16-mixed", init_scale=2.0**20, growth_interval=1)]}
    reference, _ = fit(
        ResumeModule,
        _data(2),
        {"zero_stage": 1},
        2,
        6,
        trainer_kwargs=plugins(),
        callbacks_factory=lambda: [SaveAt(tmp_path, (3,))],
    )
    saved = consolidate(tmp_path / "step3.ckpt")
    assert saved["optimizer_states"][0]["state"] == {} and saved["HybridPrecision"]["scale"] < 2.0**20
    resumed, _ = fit(
        ResumeModule,
        _data(2),
        {"zero_stage": 1},
        2,
        6,
        trainer_kwargs=plugins(),
        callbacks_factory=lambda: [SaveAt(tmp_path, resave=True)],
        fit_kwargs={"ckpt_path": str(tmp_path / "step3.ckpt")},
    )
    assert resumed.losses == reference.losses[3:]
    resaved = consolidate(tmp_path / "resaved.ckpt")
    assert resaved["HybridPrecision"] == saved["HybridPrecision"] and resaved["optimizer_states"][0]["state"] == {}


class ValLoss(L.Callback):
    """The first validation's loss (the weights a checkpoint saved at that step holds)."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results.setdefault("val_loss", float(trainer.callback_metrics["val_loss"]))


@pytest.fixture(scope="module")
def tensor_parallel_llama(tmp_path_factory):
    """Hugging Face Llama under tp=2, 6 steps, saving at step 3 and validating there (one batch): the run that
    `test_resume_from_tensor_parallel_into_zero3` continues and the tp2 case of the consolidation test exports."""
    directory = tmp_path_factory.mktemp("tensor_parallel_llama")
    result, extras = fit(
        lambda: LlamaModule(seed=0),
        lambda: RandomTokenDataModule(num_samples=32, batch_size=8, with_val=True),
        {"tensor_parallel_size": 2},
        2,
        6,
        trainer_kwargs={"limit_val_batches": 1, "val_check_interval": 3},
        callbacks_factory=lambda: [SaveAt(directory, (3,)), ValLoss()],
    )
    return directory / "step3.ckpt", result, extras[0]["val_loss"]


def test_resume_from_tensor_parallel_into_zero3(tensor_parallel_llama, tmp_path):
    """Hugging Face Llama: saved under tp=2 (DTensors sharded by heads, fused ranks), resumed under dp=2 ZeRO-3."""
    ckpt, reference, _ = tensor_parallel_llama
    data = lambda: RandomTokenDataModule(num_samples=32, batch_size=4)
    resumed = _resume(ckpt.parent, ckpt, 2, {"zero_stage": 3}, tmp_path, lambda: LlamaModule(seed=0), data, 6)
    _losses_match(reference.losses, resumed.losses, 3, CROSS_LAYOUT_RTOL)
    _assert_same_states(ckpt, tmp_path / "resaved.ckpt")


@pytest.fixture(scope="module")
def pipeline_parallel_llama(tmp_path_factory):
    """Hugging Face Llama under pp=2, 10 steps, saving at steps 3 and 4 and at each epoch's end: the uninterrupted
    run of the pp2 case of `test_every_kind_of_save_resumes_bit_identically`, and (its first 6 steps: no LR
    schedule) the run `test_resume_from_pipeline_parallel_into_zero3` continues."""
    try:
        HybridStrategy(pipeline_parallel_size=2)
    except NotImplementedError:
        pytest.skip("pipeline parallelism is not implemented in this version")
    directory = tmp_path_factory.mktemp("pipeline_parallel_llama")
    result, _ = fit(
        lambda: LlamaModule(seed=0),
        lambda: RandomTokenDataModule(num_samples=32, batch_size=8),
        {"pipeline_parallel_size": 2},
        2,
        STEPS,
        callbacks_factory=lambda: [SaveAt(directory, (3, 4)), SaveAtEpochEnd(directory)],
    )
    assert len(result.losses) == STEPS
    return directory, result


def test_resume_from_pipeline_parallel_into_zero3(pipeline_parallel_llama, tmp_path):
    """Saved by two pipeline stages (each rank holds half the model, and half the optimizer's parameters)."""
    directory, reference = pipeline_parallel_llama
    data = lambda: RandomTokenDataModule(num_samples=32, batch_size=4)
    ckpt = directory / "step3.ckpt"
    resumed = _resume(directory, ckpt, 2, {"zero_stage": 3}, tmp_path, lambda: LlamaModule(seed=0), data, 6)
    _losses_match(reference.losses[:6], resumed.losses, 3, CROSS_LAYOUT_RTOL)
    _assert_same_states(ckpt, tmp_path / "resaved.ckpt")


class SaveAtEpochEnd(L.Callback):
    """``trainer.save_checkpoint`` in ``on_train_epoch_end`` (where ``ModelCheckpoint`` saves without validation)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.directory / f"epoch{trainer.current_epoch}_end.ckpt")


RESUME_POINTS = {  # checkpoint -> the step it continues after
    "step3": 3,  # `on_train_batch_end`, mid-epoch
    "step4": 4,  # `on_train_batch_end` of the epoch's last batch
    "epoch0_end": 4,  # `on_train_epoch_end`
    "after_fit3": 3,  # after `fit(max_steps=3)` returned, mid-epoch
    "after_fit4": 4,  # after `fit(max_steps=4)` returned, at the epoch's end
}


def _resume_from_every_kind_of_save(directory: Path, saved: Path, module, data, strategy_kwargs: dict, devices: int):
    """One job, several fits: the uninterrupted run (a module fixture) saved at steps 3 and 4 and at the end of
    epoch 0 in ``saved``; runs stopped by ``max_steps`` save after ``fit`` returned; each checkpoint resumes to
    step 10."""

    def run(steps: int, **kwargs: Any) -> list[float]:
        return _fit_worker(module, data, strategy_kwargs, devices, steps, 1234, {}, None, **kwargs)["losses"]

    losses = {}
    for steps in (3, 4):
        run(steps, after_fit=lambda trainer: trainer.save_checkpoint(directory / f"after_fit{steps}.ckpt"))
    for name in RESUME_POINTS:
        path = (directory if name.startswith("after_fit") else saved) / f"{name}.ckpt"
        losses[name] = run(STEPS, fit_kwargs={"ckpt_path": str(path)})
    return losses


@pytest.mark.parametrize("layout", ["dp2-zero1", "pp2"])
def test_every_kind_of_save_resumes_bit_identically(request, tmp_path, layout):
    """Mid-epoch or at an epoch's end, from a callback or after `fit` returned: in the same layout the resumed
    run sees the same batches and gives the uninterrupted run's losses bit for bit. The uninterrupted runs are the
    module's fixtures, which saved the callback checkpoints."""
    if layout == "dp2-zero1":
        saved, uninterrupted = request.getfixturevalue("uninterrupted")
        job = (ResumeModule, _data(2), {"zero_stage": 1}, 2)
    else:
        saved, uninterrupted = request.getfixturevalue("pipeline_parallel_llama")
        job = (
            lambda: LlamaModule(seed=0),
            lambda: RandomTokenDataModule(num_samples=32, batch_size=8),
            {"pipeline_parallel_size": 2},
            2,
        )
    losses = run_distributed(_resume_from_every_kind_of_save, 2, tmp_path, saved, *job)[0]
    reference = uninterrupted.losses
    assert len(reference) == STEPS
    for name, step in RESUME_POINTS.items():
        assert losses[name] == reference[step:], (name, losses[name], reference)
    assert consolidate(tmp_path / "after_fit3.ckpt")["epoch"] == 0  # where its data stopped, not the next epoch


def test_load_from_checkpoint_reads_a_sharded_directory(uninterrupted):
    """``MyModule.load_from_checkpoint(path)`` on what a sharded save wrote (a directory): the weights
    ``consolidate`` joins, in the unmodified LightningModule."""
    directory, _ = uninterrupted
    loaded = ResumeModule.load_from_checkpoint(directory / "step6.ckpt")
    joined = consolidate(directory / "step6.ckpt")["state_dict"]
    assert loaded.state_dict().keys() == joined.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, joined[key]), key


# ------------------------------------------------------------------------------------------------------ full format
def test_full_format_is_one_plain_file_that_resumes_in_another_layout(uninterrupted, tmp_path):
    directory, reference = uninterrupted
    fit(
        ResumeModule,
        _data(2),
        {"zero_stage": 2, "checkpoint_format": "full"},
        2,
        6,
        callbacks_factory=lambda: [SaveAt(tmp_path, (6,))],
    )
    path = tmp_path / "step6.ckpt"
    assert path.is_file() and not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    full = torch.load(path, weights_only=True)  # plain torch, safe unpickler
    plain = ResumeModule()
    assert full["state_dict"].keys() == plain.state_dict().keys()
    assert full["parallel_layout"] == {
        "context_parallel_size": 1,
        "data_parallel_size": 2,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "zero_stage": 2,
        "expert_parallel_size": 1,
        "data_parallel_shard_size": None,
        "world_size": 2,
    }
    # Weights-only loading into the unmodified LightningModule, and torch's own optimizer format.
    loaded = ResumeModule.load_from_checkpoint(path)
    sharded = consolidate(directory / "step6.ckpt")  # the same step, trained under ZeRO-1
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, sharded["state_dict"][key], rtol=1e-4, atol=1e-5)
    optimizer = plain.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(full["optimizer_states"][0])
    assert optimizer.state_dict()["param_groups"] == sharded["optimizer_states"][0]["param_groups"]
    # And it resumes under HybridStrategy (dp=2, ZeRO-1: each rank takes the states of the parameters it owns)
    # where the uninterrupted run went on.
    resumed = _resume(directory, path, 2, {"zero_stage": 1}, tmp_path)
    _losses_match(reference.losses, resumed.losses, 6, CROSS_LAYOUT_RTOL)
    _assert_same_states(path, tmp_path / "resaved.ckpt")


def test_a_plain_lightning_checkpoint_resumes_under_hybrid_strategy(tmp_path):
    """From Lightning's DDP on one process (torch's optimizer format, no names) to dp=2 ZeRO-1."""
    data = lambda per_rank: lambda: RandomImageDataModule(num_samples=SAMPLES, batch_size=per_rank)
    reference, _ = fit(CNNModule, data(8), None, 1, 8, callbacks_factory=lambda: [SaveAt(tmp_path, (3,))])
    resumed, _ = fit(
        CNNModule, data(4), {"zero_stage": 1}, 2, 8, fit_kwargs={"ckpt_path": str(tmp_path / "step3.ckpt")}
    )
    _losses_match(reference.losses, resumed.losses, 3, CROSS_LAYOUT_RTOL)


# ---------------------------------------------------------------------------------------------------- consolidation
@pytest.mark.parametrize("layout", [{"zero_stage": 3}, {"tensor_parallel_size": 2}], ids=["dp2-zero3", "tp2"])
def test_consolidated_file_loads_strictly_into_the_unmodified_module(request, tmp_path, capsys, layout):
    """Sharded Llama -> `lightning-mgpu consolidate` (torch and safetensors) -> same loss on a batch."""
    steps = 3
    if "tensor_parallel_size" in layout:  # the tp2 run the resume test above continues
        ckpt, _, sharded_loss = request.getfixturevalue("tensor_parallel_llama")
        x, y = RandomTokenDataModule(num_samples=32).val_data[:8]
    else:
        _, extras = fit(
            lambda: LlamaModule(seed=0),
            lambda: RandomTokenDataModule(batch_size=4, with_val=True),
            layout,
            2,
            steps,
            trainer_kwargs={"limit_val_batches": 1, "val_check_interval": steps},
            callbacks_factory=lambda: [SaveAt(tmp_path, (steps,)), ValLoss()],
        )
        sharded_loss = extras[0]["val_loss"]
        ckpt = tmp_path / f"step{steps}.ckpt"
        x, y = RandomTokenDataModule().val_data[:8]

    def loss_of(module: LlamaModule) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(module(x).reshape(-1, 128), y.reshape(-1)))

    assert cli(["consolidate", str(ckpt), str(tmp_path / "full.ckpt")]) == 0
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    module = LlamaModule()
    module.load_state_dict(full["state_dict"], strict=True)
    assert loss_of(module) == pytest.approx(sharded_loss, rel=1e-5)
    assert loss_of(LlamaModule.load_from_checkpoint(tmp_path / "full.ckpt")) == pytest.approx(sharded_loss, rel=1e-5)

    # safetensors with Hugging Face's names, next to a config.json: `from_pretrained` takes the directory.
    hf_dir = tmp_path / "hf"
    assert cli(["consolidate", str(ckpt), str(hf_dir / "model.safetensors"), "--format", "safetensors"]) == 0
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    assert set(load_file(hf_dir / "model.safetensors")) == set(module.model.state_dict())
    hf = LlamaForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, module(x), rtol=1e-5, atol=1e-6)

    capsys.readouterr()
    assert cli(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    tp = layout.get("tensor_parallel_size", 1)
    stage = layout.get("zero_stage", 0)
    assert f"dp={2 // tp} x tp={tp} x pp=1 (zero_stage={stage}), 2 processes" in out
    assert f"global step {steps}" in out
    assert re.search(r"model\.model\.embed_tokens\.weight +\[128, 64\] +float32", out), out
    assert "Hugging Face models: model (LlamaForCausalLM)" in out


# -------------------------------------------------------------------------------------------- atomic and honest saves
class WriterFault(L.Callback):
    """Patches DCP's file writer in one rank: on its ``at``-th save it writes its shard, then dies (SIGKILL) or
    raises; ``delay`` slows every write (seconds) to show that training goes on during an asynchronous save."""

    def __init__(self, rank: int, at: int, action: str = "kill", delay: float = 0.0) -> None:
        self.rank, self.at, self.action, self.delay = rank, at, action, delay
        self.results: dict[str, Any] = {"steps_during_a_save": 0}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        original, calls, fault = FileSystemWriter.write_data, [0], self

        def write_data(writer: Any, plan: Any, planner: Any) -> Any:
            calls[0] += 1
            time.sleep(fault.delay)
            if trainer.global_rank == fault.rank and calls[0] == fault.at:
                if fault.action == "raise":
                    raise OSError("No space left on device (injected)")
                original(writer, plan, planner).wait()  # this rank's shard is on disk ...
                os.kill(os.getpid(), signal.SIGKILL)  # ... and the rank dies before the save completes
            return original(writer, plan, planner)

        FileSystemWriter.write_data = write_data

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        pending = trainer.strategy.checkpointer._pending
        if pending is not None and not pending._done.is_set():
            self.results["steps_during_a_save"] += 1

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # after the strategy's teardown
        last = getattr(trainer.checkpoint_callback, "last_model_path", "")
        self.results["last_published_at_fit_end"] = bool(last) and Path(last).is_dir()


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_resumable(uninterrupted, tmp_path):
    _, reference = uninterrupted
    callbacks = lambda: [
        ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True),
        WriterFault(rank=1, at=3),
    ]  # saves: step 2 (epoch=0-step=2, last), step 4: killed
    # The harness sees rank 1's death, or rank 0's collective failing because its peer is gone, whichever first.
    peer_gone = r"rank 1 died with exit code -9|(?s:rank 0 of 2 failed.*(closed|reset) by peer)"
    with pytest.raises(RuntimeError, match=peer_gone):
        fit(
            ResumeModule,
            _data(2),
            {"zero_stage": 1},
            2,
            STEPS,
            trainer_kwargs={"enable_checkpointing": True},
            callbacks_factory=callbacks,
            fit_kwargs={},
        )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".epoch=0-step=4.ckpt.partial", "epoch=0-step=2.ckpt", "last.ckpt"], names
    with pytest.raises(FileNotFoundError, match=r"An unfinished save was found at .*epoch=0-step=4.ckpt.partial"):
        Checkpointer().load(tmp_path / "epoch=0-step=4.ckpt", ResumeModule(), [], fitting=False)
    resumed, _ = fit(
        ResumeModule, _data(2), {"zero_stage": 1}, 2, STEPS, fit_kwargs={"ckpt_path": str(tmp_path / "last.ckpt")}
    )
    assert resumed.losses == reference.losses[2:]


def test_async_save_with_model_checkpoint_top_k(uninterrupted, tmp_path):
    """Training goes on while shards are written; old top-k directories are deleted; the last one resumes."""
    _, reference = uninterrupted
    dirpath = tmp_path / "ckpts"
    callbacks = lambda: [
        ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=2, every_n_train_steps=1, save_last=True),
        WriterFault(rank=0, at=-1, delay=0.05),
    ]
    result, extras = fit(
        ResumeModule,
        _data(2),
        {"zero_stage": 2, "async_checkpoint": True},
        2,
        6,
        trainer_kwargs={"enable_checkpointing": True},
        callbacks_factory=callbacks,
    )
    _losses_match(reference.losses[:6], result.losses, 0, CROSS_LAYOUT_RTOL)
    assert extras[0]["steps_during_a_save"] >= 3
    assert extras[0]["last_published_at_fit_end"]  # the end of `fit` waited for the last save
    names = sorted(p.name for p in dirpath.iterdir())
    best = sorted(range(1, 7), key=lambda s: result.losses[s - 1])[:2]
    assert names == sorted([f"epoch={(s - 1) // 4}-step={s}.ckpt" for s in best] + ["last.ckpt"]), names
    assert consolidate(dirpath / "last.ckpt")["global_step"] == 6
    resumed, _ = fit(
        ResumeModule, _data(2), {"zero_stage": 2}, 2, STEPS, fit_kwargs={"ckpt_path": str(dirpath / "last.ckpt")}
    )
    _losses_match(reference.losses, resumed.losses, 6, CROSS_LAYOUT_RTOL)


def test_async_save_errors_surface_at_the_next_save(tmp_path):
    callbacks = lambda: [SaveAt(tmp_path, (1, 2, 3)), WriterFault(rank=1, at=2, action="raise")]
    with pytest.raises(RuntimeError, match=r"(?s)asynchronous save of .*step2.ckpt failed.*No space left on device"):
        fit(ResumeModule, _data(2), {"zero_stage": 1, "async_checkpoint": True}, 2, 4, callbacks_factory=callbacks)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step2.ckpt.partial", "step1.ckpt"]
    Checkpointer().load(tmp_path / "step1.ckpt", ResumeModule(), [], fitting=False)  # complete and loadable


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "__1_0.distcp").unlink(), r"missing or damaged: __1_0\.distcp \(a data shard\)"),
        (lambda d: os.truncate(d / "__0_0.distcp", 100), r"__0_0\.distcp is damaged: truncated \(100 of \d+ bytes\)"),
        (lambda d: (d / "meta.pt").unlink(), r"meta\.pt \(the trainer state"),
        (lambda d: (d / ".metadata").unlink(), r"\.metadata \(DCP's index of the shards"),
        (lambda d: os.truncate(d / ".metadata", 10), r"\.metadata is damaged: truncated \(10 of"),
    ],
    ids=["shard-missing", "shard-truncated", "meta-missing", "index-missing", "index-truncated"],
)
def test_a_damaged_checkpoint_fails_naming_what_is_missing(uninterrupted, tmp_path, damage, message):
    import shutil

    directory, _ = uninterrupted
    path = tmp_path / "step3.ckpt"
    shutil.copytree(directory / "step3.ckpt", path)
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        Checkpointer().load(path, ResumeModule(), [], fitting=False)


def _save_both_formats(directory: Path) -> None:
    """One job: a sharded checkpoint saved asynchronously at step 2 (and one after `fit`, which does not wait for a
    background save), and a full file saved after `fit`."""
    _fit_worker(
        ResumeModule,
        _data(2),
        {"zero_stage": 1, "async_checkpoint": True},
        2,
        3,
        1234,
        {},
        lambda: [SaveAt(directory, (2,))],
        after_fit=lambda trainer: trainer.save_checkpoint(directory / "a.ckpt"),
    )
    _fit_worker(
        ResumeModule,
        _data(2),
        {"zero_stage": 1, "checkpoint_format": "full"},
        2,
        2,
        1234,
        {},
        None,
        after_fit=lambda trainer: trainer.save_checkpoint(directory / "full.ckpt"),
    )


def _resume_each(paths: list[Path]) -> list[str]:
    """Every rank's error for each checkpoint (an empty string where it resumed)."""
    messages = []
    for path in paths:
        try:
            _fit_worker(
                ResumeModule, _data(2), {"zero_stage": 1}, 2, 4, 1234, {}, None, fit_kwargs={"ckpt_path": str(path)}
            )
            messages.append("")
        except CheckpointError as error:
            messages.append(str(error))
    return messages


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(data)


def test_a_flipped_byte_in_any_file_is_refused_naming_the_file(tmp_path, capsys):
    """Resume (every rank refuses, none hangs), `inspect` and `consolidate` detect one flipped byte in a shard,
    DCP's index, meta.pt, the manifest, and a full file; checkpoints without a manifest load with a warning."""
    import shutil

    run_distributed(_save_both_formats, 2, tmp_path)
    sharded, full = tmp_path / "step2.ckpt", tmp_path / "full.ckpt"
    for directory in (sharded, tmp_path / "a.ckpt"):
        assert sorted(json.loads((directory / "manifest.json").read_text())["files"]) == sorted(
            p.name for p in directory.iterdir() if p.name != "manifest.json"
        )
    for intact in (sharded, full):
        capsys.readouterr()
        assert cli(["inspect", str(intact)]) == 0
        assert re.search(r"checksums: every (file|record) verified \(CRC-32\)", capsys.readouterr().out)
    damaged = {}
    for name in ("__1_0.distcp", ".metadata", "meta.pt", "manifest.json"):
        damaged[name] = tmp_path / f"damaged{len(damaged)}.ckpt"
        shutil.copytree(sharded, damaged[name])
        _flip_a_byte(damaged[name] / name)
    damaged["full.ckpt"] = tmp_path / "damaged" / "full.ckpt"
    damaged["full.ckpt"].parent.mkdir()
    shutil.copy(full, damaged["full.ckpt"])
    _flip_a_byte(damaged["full.ckpt"])

    reports = run_distributed(_resume_each, 2, [sharded, full, *damaged.values()])
    for name, messages in zip(["intact", "intact", *damaged], zip(*reports)):
        assert messages[0] == messages[1], messages  # every rank raised the same error
        if name == "intact":
            assert messages[0] == ""
            continue
        pattern = rf"^checkpoint file \S*{re.escape(name)} is damaged: .*\. It was not loaded"
        assert re.search(pattern, messages[0]), (name, messages[0])
        for command in (["inspect"], ["consolidate", "--trust"]):
            capsys.readouterr()
            out = [str(tmp_path / "out.ckpt")] if command[0] == "consolidate" else []
            assert cli([command[0], str(damaged[name]), *out, *command[1:]]) == 1
            error = capsys.readouterr().err
            said = rf"^lightning-mgpu {command[0]}: error: checkpoint file \S*{re.escape(name)} is damaged"
            assert re.search(said, error), error
            assert len(error.splitlines()) == 1, error
    assert not (tmp_path / "out.ckpt").exists()

    # A manifest that still parses but was altered fails its own checksum.
    manifest = damaged["manifest.json"] / "manifest.json"
    shutil.copy(sharded / "manifest.json", manifest)
    manifest.write_text(manifest.read_text().replace('"size": ', '"size": 1', 1))
    with pytest.raises(CheckpointError, match=r"manifest\.json is damaged: crc32 mismatch of its own content"):
        Checkpointer().load(damaged["manifest.json"], ResumeModule(), [], fitting=False)
    # Without the manifest: an error for a checkpoint of this version, a warning for one saved before manifests.
    (damaged["manifest.json"] / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        Checkpointer().load(damaged["manifest.json"], ResumeModule(), [], fitting=False)
    old = tmp_path / "old.ckpt"
    shutil.copytree(sharded, old)
    (old / "manifest.json").unlink()
    meta = torch.load(old / "meta.pt", weights_only=False)
    meta["lightning_mgpu"]["format_version"] = 1
    torch.save(meta, old / "meta.pt")
    with pytest.warns(UserWarning, match=r"old\.ckpt has no manifest\.json \(saved by an earlier version\)"):
        Checkpointer().load(old, ResumeModule(), [], fitting=False)


def test_loading_names_missing_entries_and_respects_strict(uninterrupted, tmp_path):
    directory, _ = uninterrupted
    module = ResumeModule()
    module.extra = torch.nn.Linear(2, 2)
    message = r"no entry for 2 of the model's 12 parameters and buffers: extra\.weight, extra\.bias"
    with pytest.raises(CheckpointError, match=message):
        Checkpointer().load(directory / "step3.ckpt", module, [], strict=True, fitting=False)
    Checkpointer().load(directory / "step3.ckpt", module, [], strict=False, fitting=False)
    torch.testing.assert_close(module.head.weight, consolidate(directory / "step3.ckpt")["state_dict"]["head.weight"])
    # A weights-only file initializes a model but cannot resume training.
    write_consolidated(directory / "step3.ckpt", tmp_path / "weights.ckpt", weights_only=True)
    plain = ResumeModule()
    with pytest.raises(CheckpointError, match=r"has no state for optimizer 0 .*save_weights_only"):
        Checkpointer().load(tmp_path / "weights.ckpt", plain, [plain.configure_optimizers()["optimizer"]])
    (tmp_path / "broken.ckpt").write_bytes((tmp_path / "weights.ckpt").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"broken.ckpt could not be read, it is truncated or corrupt"):
        Checkpointer().load(tmp_path / "broken.ckpt", plain, [], fitting=False)


def _gpt_of(n_layer: int = 4, n_embd: int = 32, strict: bool = True):
    def make():
        module = _gpt(n_layer=n_layer, n_embd=n_embd)
        module.strict_loading = strict
        return module

    return make


def _resume_other_models(directory: Path, strategy_kwargs: dict, devices: int) -> dict[str, Any]:
    """One job: a 4-layer GPT saves; a 2-layer one resumes strictly (an error), then with `strict_loading=False`;
    a wider one resumes (an error). Every rank reports the error it raised."""

    def run(module, steps: int = 2, **kwargs: Any) -> Any:
        try:
            return _fit_worker(
                module, _sonnets(GLOBAL_BATCH), strategy_kwargs, devices, steps, 1234, {}, None, **kwargs
            )["losses"]
        except CheckpointError as error:
            return str(error)

    ckpt = directory / "four_layers.ckpt"
    run(_gpt_of(4), 1, after_fit=lambda trainer: trainer.save_checkpoint(ckpt))
    return {
        "fewer_layers": run(_gpt_of(2), fit_kwargs={"ckpt_path": str(ckpt)}),
        "fewer_layers_not_strict": run(_gpt_of(2, strict=False), fit_kwargs={"ckpt_path": str(ckpt)}),
        "wider": run(_gpt_of(4, n_embd=48), fit_kwargs={"ckpt_path": str(ckpt)}),
    }


@pytest.mark.parametrize(
    "layout",
    [{"zero_stage": 3}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["dp2-zero3", "tp2", "pp2"],
)
def test_a_checkpoint_that_does_not_fit_the_model_fails_early_naming_why(tmp_path, layout):
    """Checked from the checkpoint's index before any data is read; under pipeline parallelism the entries of
    other stages are not "unexpected"; every rank raises the same short message."""
    reports = run_distributed(_resume_other_models, 2, tmp_path, layout, 2)
    for report in reports:
        fewer = report["fewer_layers"]
        assert isinstance(fewer, str) and fewer == reports[0]["fewer_layers"], fewer
        assert re.search(
            r"four_layers\.ckpt does not fit the model: it has 24 entries the model does not have:"
            r" model\.transformer\.h\.2\.\*, model\.transformer\.h\.3\.\* \(set `strict_loading = False`",
            fewer,
        ), fewer
        assert isinstance(report["fewer_layers_not_strict"], list) and len(report["fewer_layers_not_strict"]) == 1
        wider = report["wider"]
        assert isinstance(wider, str) and len(wider) < 600, wider
        assert re.search(
            r"shapes differ: model\.transformer\.wte\.weight is \[\d+, 48\] in the model, \[\d+, 32\] in"
            r" the checkpoint",
            wider,
        ), wider
        assert "strict_loading" not in wider  # no escape from a shape mismatch


def test_fast_forward_skips_indices_of_map_style_data_and_batches_of_iterables():
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    class Counting(Dataset):
        def __init__(self) -> None:
            self.fetched: list[int] = []

        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> int:
            self.fetched.append(i)
            return i

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    data = Counting()
    loader = DataLoader(data, batch_size=2)
    forward = FastForward(loader, skip=3, epoch=0)
    assert len(forward) == 5 and forward.batch_size == 2
    assert [b.tolist() for b in forward] == [[6, 7], [8, 9]]
    assert data.fetched == [6, 7, 8, 9]  # nothing loaded for the skipped batches
    assert [b.tolist() for b in forward][0] == [0, 1]  # only the first epoch after the resume is shortened
    assert [b.tolist() for b in FastForward(DataLoader(Stream(), batch_size=4), skip=2, epoch=0)] == [[8, 9]]


def test_async_checkpoint_needs_the_sharded_format():
    with pytest.raises(ValueError, match=r"`async_checkpoint=True` .* needs `checkpoint_format='sharded'`, got 'full'"):
        HybridStrategy(async_checkpoint=True, checkpoint_format="full")


def test_the_default_format_is_one_file_and_sharded_with_async_saves():
    assert HybridStrategy().checkpointer.checkpoint_format == "full"
    assert HybridStrategy(async_checkpoint=True).checkpointer.checkpoint_format == "sharded"


class _SaveAfterFit(L.Callback):
    """``trainer.save_checkpoint`` once training ended, recording the warnings it raised on this rank."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.save_checkpoint(self.path)
        self.results["warnings"] = [str(w.message) for w in caught]


def test_a_default_save_that_would_not_fit_rank_zero_is_kept_sharded_saying_so(tmp_path, monkeypatch):
    """Joining the shards into one file needs the whole state in rank 0's memory: with too little free (faked, in
    the forked ranks too) the directory is published instead, complete and loadable, with a warning."""
    from lightning_mgpu.checkpoint import format as fmt

    monkeypatch.setattr(fmt, "free_memory_bytes", lambda: 4096)
    path = tmp_path / "big.ckpt"
    _, extras = fit(ResumeModule, _data(2), {"zero_stage": 1}, 2, 2, callbacks_factory=lambda: [_SaveAfterFit(path)])
    assert path.is_dir() and fmt.is_sharded_checkpoint(path)
    warned = [w for w in extras[0]["warnings"] if "as a sharded checkpoint (a directory), not as one file" in w]
    assert warned and "lightning-mgpu consolidate" in warned[0], extras[0]["warnings"]
    Checkpointer().load(path, ResumeModule(), [], fitting=False)  # complete and loadable
    assert consolidate(path)["state_dict"].keys() == ResumeModule().state_dict().keys()


def _gpt(n_layer: int = 2, n_embd: int = 32):
    from lightning_mgpu.demo import GPTLightningModule

    return GPTLightningModule(block_size=32, n_layer=n_layer, n_head=4, n_embd=n_embd, lr=1e-3)


def _sonnets(batch: int):
    from lightning_mgpu.demo import TextDataModule

    return lambda: TextDataModule(batch_size=batch, block_size=32, val_fraction=0.0)


_gpt_reference: dict = {}


ROUND_TRIPS = [  # the acceptance: (save layout, devices, dp) -> (resume layout, devices, dp)
    (({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, 1), ({"zero_stage": 3}, 2, 2)),
    (({"tensor_parallel_size": 2, "zero_stage": 3}, 4, 2), ({"pipeline_parallel_size": 2, "zero_stage": 1}, 4, 2)),
    (({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1}, 8, 2), ({}, 1, 1)),
]


@pytest.mark.parametrize(
    ("saved", "resumed"), ROUND_TRIPS, ids=["pp2tp2-to-dp2z3", "dp2tp2z3-to-pp2dp2z1", "pp2dp2tp2-to-1proc"]
)
def test_transformer_round_trips_between_3d_layouts(tmp_path, saved, resumed):
    """Save mid-run in one 3D layout, resume in another: the states are equal after loading and the losses follow
    the uninterrupted single-process run."""
    if "losses" not in _gpt_reference:
        _gpt_reference["losses"] = fit(_gpt, _sonnets(GLOBAL_BATCH), None, 1, 6)[0].losses
    reference = _gpt_reference["losses"]
    (save_kwargs, save_devices, save_dp), (resume_kwargs, resume_devices, resume_dp) = saved, resumed
    first, _ = fit(
        _gpt,
        _sonnets(GLOBAL_BATCH // save_dp),
        save_kwargs,
        save_devices,
        3,
        callbacks_factory=lambda: [SaveAt(tmp_path, steps=(3,))],
    )
    _losses_match(reference[:3], first.losses, 0, CROSS_LAYOUT_RTOL)
    resave_dir = tmp_path / "after"
    second, _ = fit(
        _gpt,
        _sonnets(GLOBAL_BATCH // resume_dp),
        resume_kwargs or None if resume_devices > 1 else resume_kwargs,
        resume_devices,
        6,
        callbacks_factory=lambda: [SaveAt(resave_dir, resave=True)],
        fit_kwargs={"ckpt_path": str(tmp_path / "step3.ckpt")},
    )
    _losses_match(reference, second.losses, 3, CROSS_LAYOUT_RTOL)
    _assert_same_states(tmp_path / "step3.ckpt", resave_dir / "resaved.ckpt")


class _AveragedMLP(L.LightningModule):
    """Two residual blocks of Linear layers (splittable by tensor parallelism), validated each epoch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)) for _ in range(2)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _averaged_fits(directory: Path, strategy_kwargs: dict, dp: int) -> dict[str, Any]:
    """EMA over 2 epochs saving each epoch's end, then a resume from epoch 0's checkpoint: its losses and final
    (averaged) weights."""
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))

    def fit(callbacks: list, ckpt_path: Path | None = None) -> dict[str, Any]:
        module, losses, ema = _AveragedMLP(), [], EMAWeightAveraging(decay=0.5)
        record = L.pytorch.callbacks.LambdaCallback(
            on_train_batch_end=lambda trainer, *_: losses.append(float(trainer.callback_metrics["train_loss"]))
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=HybridStrategy(**strategy_kwargs),
            max_epochs=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[ema, record, *callbacks],
        )
        loader = DataLoader(data, batch_size=16 // dp)
        trainer.fit(module, loader, loader, ckpt_path=ckpt_path)
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        # Given back as made: the callback's own methods, its copy's plain tensors holding the average.
        assert not {"_swap_models", "_copy_average_to_current"} & set(vars(ema))
        averaged = ema._average_model.module.state_dict()
        assert not any(isinstance(v, DTensor) for v in averaged.values())
        torch.testing.assert_close(averaged, weights, rtol=0, atol=0)
        return {"losses": losses, "weights": weights}

    every = ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    uninterrupted = fit([every])
    saved = directory / "epoch=0.ckpt"
    whole = consolidate(saved) if saved.is_dir() else torch.load(saved, weights_only=True)
    average, current = whole["state_dict"], whole["current_model_state"]
    resumed = fit([], ckpt_path=saved)
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "apart": max((average[k] - current[k]).abs().max() for k in average),
    }


@pytest.mark.parametrize(
    "strategy_kwargs, dp",
    [
        ({"tensor_parallel_size": 2, "checkpoint_format": "sharded"}, 1),
        ({"tensor_parallel_size": 2, "tp_plan": {"blocks.*.0": "colwise", "blocks.*.2": "rowwise"}}, 1),
        ({"zero_stage": 3, "checkpoint_format": "sharded"}, 2),
        ({"zero_stage": 2}, 2),
    ],
    ids=["tp2-sharded", "tp2-plan-full", "zero3-sharded", "zero2-full"],
)
def test_weight_averaging_resumes_the_average_and_the_current_weights(tmp_path, strategy_kwargs, dp):
    """EMAWeightAveraging's checkpoint holds the average (``state_dict``) and the current weights
    (``current_model_state``), both sharded as the module; a resume from epoch 0 continues with the current weights
    (the same losses) and ends with the uninterrupted run's average."""
    result = run_distributed(_averaged_fits, 2, tmp_path, strategy_kwargs, dp)[0]
    uninterrupted, resumed = result["uninterrupted"], result["resumed"]
    steps = len(uninterrupted["losses"]) // 2
    torch.testing.assert_close(resumed["losses"], uninterrupted["losses"][steps:], rtol=1e-6, atol=0)
    torch.testing.assert_close(resumed["weights"], uninterrupted["weights"], rtol=1e-6, atol=1e-7)
    assert result["apart"] > 1e-3  # the saved average is not the current weights
