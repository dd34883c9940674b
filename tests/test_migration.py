"""Coming from Lightning's strategies (docs/guides/migration.md): every claim of the guide about their checkpoints
and modules, tested.

Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` (its FSDP2 form: ``fully_shard`` over its
``data_parallel`` mesh in ``configure_model``; ``FSDPStrategy`` needs CUDA) train a small GPT on 2 CPU processes
(3 steps an epoch) and save: a plain Lightning ``.ckpt`` (DDP: mid-epoch at step 2 and at the epoch's end, step 3),
a sharded DCP directory and a full file (ModelParallel, step 3). ``HybridStrategy`` resumes each under other
layouts and must continue the uninterrupted DDP run to step 5 (the same global batches), mid-epoch too. The
samples a batch step takes stay those of the saved run (data-parallel size x DataLoader batch size: tp 2 or pp 2 on
the same 2 processes take batches of 8), as the guide says to. A plain file under pipeline parallelism is refused
naming the one-time conversion, which the test then runs. The ModelParallelStrategy module (reading
``self.device_mesh["data_parallel"]`` and sharding itself) trains unchanged under ``HybridStrategy(zero_stage=3)``.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_mgpu import HybridStrategy
from lightning_mgpu.checkpoint import CheckpointError
from lightning_mgpu.demo import GPTLightningModule
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import LossRecorder
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.tiers import case

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, lr=1e-3, weight_decay=0.0)
MID_EPOCH, SAVED_AT, STEPS = 2, 3, 5  # 3 steps an epoch (24 samples, 4 per rank, 2 ranks)
LOSS_RTOL, WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-4, 1e-5


class ModelParallelGPT(GPTLightningModule):
    """A module written for Lightning's ModelParallelStrategy: FSDP2 over its ``data_parallel`` mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)


def _fit(
    strategy: Any, steps: int, module: type = GPTLightningModule, batch_size: int = 4, **fit: Any
) -> tuple[L.Trainer, list[float]]:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    L.seed_everything(1, verbose=False)
    model = module(**GPT)
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, RandomTokenDataModule(vocab_size=64, seq_len=16, num_samples=24, batch_size=batch_size), **fit)
    return trainer, recorder.losses


def _weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    module = trainer.lightning_module
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _lightning_saves(directory: Path) -> dict[str, Any]:
    """Each Lightning strategy's checkpoints, and DDP's uninterrupted run to step 5 (the reference)."""
    for steps, name in ((MID_EPOCH, "ddp-mid-epoch.ckpt"), (SAVED_AT, "ddp.ckpt")):
        trainer, _ = _fit(DDPStrategy(), steps)
        trainer.save_checkpoint(directory / name)
    trainer, losses = _fit(DDPStrategy(), STEPS)
    reference = {"losses": losses, "weights": _weights(trainer)}
    trainer, mp_losses = _fit(
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), SAVED_AT, ModelParallelGPT
    )
    trainer.save_checkpoint(directory / "model_parallel")  # a sharded DCP directory
    full = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)
    trainer, _ = _fit(full, SAVED_AT, ModelParallelGPT)
    trainer.save_checkpoint(directory / "model_parallel.ckpt")  # one file, gathered on rank 0
    return reference | {"model_parallel_losses": mp_losses}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lightning")
    return directory, run_distributed(_lightning_saves, 2, directory)[0]


def _resume(path: Path, layout: dict[str, Any]) -> dict[str, Any]:
    # dp 1 (tp 2 or pp 2 on the 2 processes) takes batches of 8: the samples of the saved run's batch steps
    batch_size = 8 if layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1) > 1 else 4
    trainer, losses = _fit(HybridStrategy(**layout), STEPS, batch_size=batch_size, ckpt_path=path)
    return {"losses": losses, "weights": trainer.strategy.full_state_dict()}


def _assert_continues(resumed: dict[str, Any], reference: dict[str, Any]) -> None:
    """The uninterrupted run's last steps: the same losses, the same weights."""
    got = resumed["losses"]
    torch.testing.assert_close(got, reference["losses"][-len(got) :], rtol=LOSS_RTOL, atol=0)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(
            resumed["weights"][name], value, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )


RESUMES = [
    case("ddp-mid-epoch.ckpt", {"zero_stage": 3}, id="ddp-file-mid-epoch-zero3"),
    case("ddp.ckpt", {"tensor_parallel_size": 2}, id="ddp-file-tp2"),
    case("model_parallel", {"pipeline_parallel_size": 2}, id="model-parallel-dir-pp2"),
    case("model_parallel.ckpt", {"zero_stage": 1}, id="model-parallel-file-zero1", slow=True),
    case("ddp.ckpt", {"zero_stage": 1}, id="ddp-file-zero1", slow=True),
    case("ddp-mid-epoch.ckpt", {"tensor_parallel_size": 2}, id="ddp-file-mid-epoch-tp2", slow=True),
    case("ddp-mid-epoch.ckpt", {"pipeline_parallel_size": 2}, id="ddp-file-mid-epoch-pp2-refused", slow=True),
    case("model_parallel", {"zero_stage": 3}, id="model-parallel-dir-zero3", slow=True),
    case("model_parallel", {"tensor_parallel_size": 2}, id="model-parallel-dir-tp2", slow=True),
    case("model_parallel.ckpt", {"tensor_parallel_size": 2}, id="model-parallel-file-tp2", slow=True),
]


@pytest.mark.parametrize(("name", "layout"), RESUMES)
def test_a_lightning_checkpoint_resumes_under_another_layout(saved, name, layout):
    directory, reference = saved
    if name.endswith(".ckpt") and layout.get("pipeline_parallel_size", 1) > 1:
        with pytest.raises(RuntimeError, match="is a plain Lightning checkpoint"):
            run_distributed(_resume, 2, directory / name, layout)
        return
    _assert_continues(run_distributed(_resume, 2, directory / name, layout)[0], reference)


def _convert_then_pipeline(directory: Path) -> dict[str, Any]:
    """The plain file under pp 2 is refused; converted as the refusal says, it resumes under pp 2."""
    try:
        _fit(HybridStrategy(pipeline_parallel_size=2), STEPS, batch_size=8, ckpt_path=directory / "ddp.ckpt")
        refusal = "no error"
    except CheckpointError as error:
        refusal = str(error)
    trainer, losses = _fit(HybridStrategy(), SAVED_AT, ckpt_path=directory / "ddp.ckpt")  # nothing trains
    trainer.save_checkpoint(directory / "converted")
    return {"refusal": refusal, "trained": losses} | _resume(directory / "converted", {"pipeline_parallel_size": 2})


def test_a_plain_checkpoint_under_a_pipeline_is_refused_with_the_conversion_which_works(saved):
    directory, reference = saved
    result = run_distributed(_convert_then_pipeline, 2, directory)[0]
    assert "is a plain Lightning checkpoint" in result["refusal"] and "max_steps" in result["refusal"], result
    assert result["trained"] == []  # the conversion ran no step
    _assert_continues(result, reference)


def _model_parallel_module_under_hybrid() -> list[float]:
    return _fit(HybridStrategy(zero_stage=3), SAVED_AT, ModelParallelGPT)[1]


def test_a_module_written_for_model_parallel_strategy_trains_unchanged(saved):
    _, reference = saved
    losses = run_distributed(_model_parallel_module_under_hybrid, 2)[0]
    torch.testing.assert_close(losses, reference["model_parallel_losses"], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(losses, reference["losses"][:SAVED_AT], rtol=LOSS_RTOL, atol=0)  # and as DDP


def test_a_deepspeed_checkpoint_is_refused_naming_the_conversion(tmp_path):
    """Lightning's DeepSpeedStrategy writes DeepSpeed's own directory (a ``latest`` tag, ``<tag>/mp_rank_*``)."""
    from lightning_mgpu.checkpoint import Checkpointer

    (tmp_path / "global_step3").mkdir()
    (tmp_path / "latest").write_text("global_step3")
    torch.save({"module": {}}, tmp_path / "global_step3" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"is a DeepSpeed checkpoint.*convert_zero_checkpoint_to_fp32_state_dict"):
        Checkpointer().load(tmp_path, GPTLightningModule(**GPT), [], fitting=False)


def _as_fsdp_strategy_names(source: Path, target: Path) -> None:
    """ModelParallelStrategy's directory with FSDPStrategy's model prefix (``model.<fqn>``): a stand-in, as
    FSDPStrategy needs CUDA; the rest of the two formats is the same (``optimizer_<i>``, ``meta.pt``)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from lightning_mgpu._compat.dcp import load_without_process_group

    state = load_without_process_group(source)
    state["model"] = state.pop("state_dict")
    dcp.save(state, checkpoint_id=target, no_dist=True)
    shutil.copy(source / "meta.pt", target / "meta.pt")


@pytest.mark.slow  # a stand-in for a format the tests cannot write (FSDPStrategy needs CUDA)
def test_fsdp_strategys_entry_names_are_read_too(saved, tmp_path):
    directory, reference = saved
    _as_fsdp_strategy_names(directory / "model_parallel", tmp_path / "fsdp")
    _assert_continues(run_distributed(_resume, 2, tmp_path / "fsdp", {"zero_stage": 2})[0], reference)


def _sharding_refusals() -> list[str]:
    """In a forked process (the fake process group leaves state that later forks would inherit)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_mgpu._compat.c10d import fake_store
    from lightning_mgpu.parallel.data import sharded_by_user

    dist.init_process_group("fake", rank=0, world_size=2, store=fake_store())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    whole, part = GPTLightningModule(**GPT), GPTLightningModule(**GPT)
    fully_shard(whole.model, mesh=mesh)
    fully_shard(part.model.transformer.h[0], mesh=mesh)
    assert sharded_by_user(whole, 3, 1) and not sharded_by_user(GPTLightningModule(**GPT), 0, 1)
    said = []
    for module, zero, pp in ((whole, 1, 1), (whole, 3, 2), (part, 3, 1)):
        try:
            sharded_by_user(module, zero, pp)
            said.append("no error")
        except (ValueError, NotImplementedError) as error:
            said.append(str(error))
    return said


def test_a_module_sharding_itself_is_refused_where_that_cannot_work():
    """``fully_shard`` in configure_model with another ZeRO stage, a pipeline, or part of the module left out."""
    other_stage, pipeline, part = run_distributed(_sharding_refusals, 1)[0]
    assert re.search(r"applied fully_shard .* itself, but zero_stage=1\. Set zero_stage=3", other_stage)
    assert "pipeline_parallel_size=2 splits the module" in pipeline
    assert "to part of the module only: ['model.transformer.wte.weight'" in part
