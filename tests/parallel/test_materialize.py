"""Modules built without memory: parameters on the meta device, buffers real, initialized like one process.

Without processes: what ``parameters_on_meta`` builds (a Hugging Face Llama's parameters on meta, its rotary
frequencies real, its tied head tied), and the refusal of a module that owns a tensor nothing initializes. Under tp 2,
pp 2 and ZeRO-3: the tensors a checkpoint lacks (BERT's new head and pooler) equal ``from_pretrained``'s on one
process, the rotary frequencies equal a CPU-built model's, and the route a Lightning user takes
(``trainer.init_module(empty_init=True)``, then torch's DCP load in ``on_fit_start``) trains like one process.
A checkpoint holding NaN stops setup naming the tensor.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_mgpu.parallel.materialize import UninitializableModule, parameters_on_meta, plan_initialization
from tests.helpers.distributed import run_distributed, run_each, traceback_of
from tests.helpers.equivalence import LossRecorder
from tests.helpers.modules import LlamaModule, RandomTokenDataModule
from tests.helpers.pretrained import FineTune, save_checkpoint

LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}, "zero3": {"zero_stage": 3}}
QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def test_parameters_on_meta_keep_buffers_and_ties():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=True,
    )
    with parameters_on_meta():
        model = LlamaForCausalLM(config)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, still one parameter
    built = LlamaForCausalLM(config)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, built.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert not any(b.is_meta for b in model.buffers())


class _Scaled(nn.Module):
    """A module whose own parameter has no initializer (nothing resets ``scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))


class _Forgetful(nn.Linear):
    def reset_parameters(self) -> None:  # initializes the weight, forgets the bias
        nn.init.zeros_(self.weight)


def test_a_tensor_nothing_initializes_is_refused_by_name():
    with parameters_on_meta():
        module = _Scaled()
    with pytest.raises(UninitializableModule, match=r"_Scaled \(_Scaled: scale\).*reset_parameters\(\)"):
        plan_initialization(module, loaded=set())
    assert not plan_initialization(module, loaded={"scale", "linear.weight", "linear.bias"})  # all from a checkpoint
    with parameters_on_meta():
        forgetful = _Forgetful(2, 2)
    from lightning_mgpu.parallel.materialize import initialize_missing, materialize

    plan = plan_initialization(forgetful, loaded=set())
    materialize(forgetful, torch.device("cpu"))
    with pytest.raises(UninitializableModule, match=r"_Forgetful.reset_parameters\(\) left bias uninitialized"):
        initialize_missing(plan)


# ------------------------------------------------------------------------------------------------- under layouts
@functools.cache
def _checkpoints(root: str) -> dict[str, str]:
    return {name: str(save_checkpoint(name, Path(root))) for name in ("bert", "llama")}


class _Captured(L.Callback):
    """What training starts from: the new head and pooler gathered, the rotary frequencies of this rank."""

    def __init__(self) -> None:
        self.results: dict = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        full = trainer.strategy.full_state_dict()
        self.results["new"] = {k: v.clone() for k, v in full.items() if "classifier" in k or "pooler" in k}


def _new_head(path: str, layout: str) -> dict:
    from lightning_mgpu import HybridStrategy

    L.seed_everything(7, verbose=False)
    captured = _Captured()
    strategy = HybridStrategy(pretrained=path, pretrained_strict=False, **LAYOUTS[layout])
    trainer = L.Trainer(devices=2, strategy=strategy, max_steps=1, callbacks=[captured], **QUIET)
    trainer.fit(FineTune(path), RandomTokenDataModule(batch_size=4))
    return captured.results


class _RotaryProbe(L.Callback):
    def __init__(self) -> None:
        self.results: dict = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results["inv_freq"] = pl_module.model.model.rotary_emb.inv_freq.detach().clone()


class _LoadsWithDCP(LlamaModule):
    """The route a Lightning user takes: built under ``trainer.init_module(empty_init=True)``, the pretrained
    weights loaded into the sharded model with torch's DCP."""

    def __init__(self, weights: str) -> None:
        super().__init__()
        self.weights = weights

    def on_fit_start(self) -> None:
        state = self.state_dict()
        dcp.load(state, checkpoint_id=self.weights)
        self.load_state_dict(state)


def _init_module_then_dcp(weights: str, layout: str) -> dict:
    from lightning_mgpu import HybridStrategy

    L.seed_everything(7, verbose=False)
    recorder, probe = LossRecorder(), _RotaryProbe()
    strategy = HybridStrategy(**LAYOUTS[layout])
    trainer = L.Trainer(devices=2, strategy=strategy, max_steps=3, callbacks=[recorder, probe], **QUIET)
    with trainer.init_module(empty_init=True):
        module = _LoadsWithDCP(weights)
    trainer.fit(module, RandomTokenDataModule(batch_size=8 if layout != "zero3" else 4))
    return {"losses": recorder.losses, "inv_freq": probe.results["inv_freq"]}


def _nan_checkpoint(path: str) -> str:
    from lightning_mgpu import HybridStrategy

    strategy = HybridStrategy(pretrained=path, tensor_parallel_size=2)
    trainer = L.Trainer(devices=2, strategy=strategy, max_steps=1, **QUIET)
    trainer.fit(FineTune(path), RandomTokenDataModule(batch_size=4))
    return "trained"


def _layouts_job(paths: dict[str, str], weights: str, nan_path: str) -> dict:
    checks = {f"head-{layout}": functools.partial(_new_head, paths["bert"], layout) for layout in LAYOUTS}
    checks |= {f"dcp-{layout}": functools.partial(_init_module_then_dcp, weights, layout) for layout in LAYOUTS}
    checks["nan"] = functools.partial(_nan_checkpoint, nan_path)
    return run_each(checks)


@functools.cache
def _results(root: str) -> tuple[dict, dict]:
    paths = _checkpoints(root)
    # The one-process references: from_pretrained's new head; a CPU-built Llama's training from the DCP weights.
    L.seed_everything(7, verbose=False)
    reference = FineTune(paths["bert"], from_pretrained=True).state_dict()
    weights = os.path.join(root, "dcp")
    L.seed_everything(3, verbose=False)
    source = LlamaModule()
    dcp.save(source.state_dict(), checkpoint_id=weights, no_dist=True)
    nan_path = os.path.join(root, "nan")
    model = FineTune(paths["llama"], from_pretrained=True).model
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(nan_path, max_shard_size="100KB")
    references = {"head": {k: v for k, v in reference.items() if "classifier" in k or "pooler" in k}}
    references["dcp"] = run_distributed(_one_process_from_dcp, 1, weights)[0]
    return references, run_distributed(_layouts_job, 2, paths, weights, nan_path)[0]


def _one_process_from_dcp(weights: str) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    L.seed_everything(7, verbose=False)
    recorder, probe = LossRecorder(), _RotaryProbe()
    trainer = L.Trainer(devices=1, strategy=DDPStrategy(), max_steps=3, callbacks=[recorder, probe], **QUIET)
    trainer.fit(_LoadsWithDCP(weights), RandomTokenDataModule(batch_size=8))
    return {"losses": recorder.losses, "inv_freq": probe.results["inv_freq"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("materialize")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensors_a_checkpoint_lacks_equal_from_pretrained_on_one_process(results, layout):
    references, got = results
    out = got[f"head-{layout}"]
    assert traceback_of(out) is None, traceback_of(out)
    assert set(out["new"]) == set(references["head"]) and len(out["new"]) == 4
    for key, value in references["head"].items():
        torch.testing.assert_close(out["new"][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_module_empty_init_then_a_dcp_load_trains_like_one_process(results, layout):
    references, got = results
    out = got[f"dcp-{layout}"]
    assert traceback_of(out) is None, traceback_of(out)
    torch.testing.assert_close(out["inv_freq"], references["dcp"]["inv_freq"], rtol=0, atol=0)
    assert all(torch.isfinite(torch.tensor(out["losses"])))
    torch.testing.assert_close(
        torch.tensor(out["losses"]), torch.tensor(references["dcp"]["losses"]), rtol=1e-5, atol=0
    )


def test_a_checkpoint_holding_nan_stops_setup_naming_the_tensor(results):
    _, got = results
    failure = traceback_of(got["nan"])
    assert failure is not None and "NonFiniteWeights" in failure, got["nan"]
    assert "model.model.norm.weight" in failure


def test_a_first_loss_that_is_not_a_number_stops_the_run():
    from lightning_mgpu.strategy.weights import NonFiniteWeights, check_first_loss

    check_first_loss(torch.tensor(2.5))
    check_first_loss({"loss": torch.tensor(2.5)})
    check_first_loss(None)  # a step that returns nothing (manual optimization) has no loss to check
    with pytest.raises(NonFiniteWeights, match="first training loss is nan"):
        check_first_loss({"loss": torch.tensor(float("nan"))})
