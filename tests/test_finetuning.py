"""The fine-tuning workflow: frozen layers, a backbone unfrozen mid-training, LoRA adapters, equal to one process.

- Lightning's ``BackboneFinetuning`` (the backbone frozen at setup, unfrozen at epoch 1 as a new parameter group of
  the optimizer) on the ``computer_vision_fine_tuning`` example's shape, under ZeRO 0-3 and pp 2. DDP reduces the
  gradients of the parameters that were trainable when its reducer was built: the backbone's are reduced after it
  unfreezes because the reducer is rebuilt (Lightning's ``DDPStrategy`` leaves them unreduced, each rank training
  on its own half of the batch). Under pp 2 the first stage holds only frozen layers until then.
- A Hugging Face Llama with its embeddings and first block frozen, under ZeRO 0/3, tp 2 and pp 2.
- LoRA adapters from ``peft`` on the attention's q/v projections under ZeRO 0/1/3, tp 2 and pp 2, and on every
  projection of the blocks (beside column- and row-parallel ones) under tp 2, also with sequence parallelism.

Each run trains 12 steps (3 epochs) against one process on the global batch: losses within 1e-5 relative, weights
within 1e-4; optimizer state exists only for trainable parameters on every rank.
"""

from __future__ import annotations

import functools
from functools import partial

import lightning as L
import pytest
from lightning.pytorch.callbacks import BackboneFinetuning

from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.equivalence import assert_same_training
from tests.helpers.finetuning import (
    LLAMA_PROJECTIONS,
    FrozenEmbeddingsLM,
    ImageDataModule,
    LoraLM,
    TransferLearningModel,
)
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.tiers import case

GLOBAL_BATCH = 8
STEPS = 12  # 3 epochs of 4 steps: the backbone unfreezes when the second starts
WEIGHT_ATOL = 1e-4


class OptimizerState(L.Callback):
    """At the last optimizer step: on this rank, the parameters with optimizer state and those requiring a grad."""

    def __init__(self) -> None:
        self.results: dict = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step == STEPS - 1:
            stateful = {id(p) for p, state in optimizer.state.items() if state}
            frozen = {id(p) for p in pl_module.parameters() if not p.requires_grad}
            self.results = {"stateful": len(stateful), "stateful_frozen": len(stateful & frozen)}


def _backbone_callbacks() -> list[L.Callback]:
    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5), OptimizerState()]


def _state_only() -> list[L.Callback]:
    return [OptimizerState()]


MODELS = {  # name: (module, data, callbacks)
    "backbone": (partial(TransferLearningModel, norm="group"), ImageDataModule, _backbone_callbacks),
    "frozen": (FrozenEmbeddingsLM, RandomTokenDataModule, _state_only),
    "lora": (LoraLM, RandomTokenDataModule, _state_only),
    "lora_all": (partial(LoraLM, target_modules=LLAMA_PROJECTIONS), RandomTokenDataModule, _state_only),
}
LAYOUTS = {
    "z0": {},
    "z1": {"zero_stage": 1},
    "z2": {"zero_stage": 2},
    "z3": {"zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "tp2sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
}
CASES = {
    "backbone": ["z0", "z1", "z2", "z3", "pp2"],
    "frozen": ["z0", "z3", "tp2", "tp2sp", "pp2"],
    "lora": ["z0", "z1", "z3", "tp2", "pp2"],
    "lora_all": ["tp2", "tp2sp"],
}
QUICK = {"backbone/z0", "backbone/z3", "backbone/pp2", "frozen/tp2", "lora/z3", "lora_all/tp2"}
NAMES = [f"{model}/{layout}" for model, layouts in CASES.items() for layout in layouts]


def _run(name: str) -> Run:
    model, layout = name.split("/")
    module, data, callbacks = MODELS[model]
    dp = 2 if layout.startswith("z") else 1
    return Run(
        module, partial(data, batch_size=GLOBAL_BATCH // dp), LAYOUTS[layout], STEPS, callbacks_factory=callbacks
    )


@functools.cache
def _trained(slow: bool) -> dict:
    names = [name for name in NAMES if (name not in QUICK) == slow]
    return fit_each({name: _run(name) for name in names}, 2)


@functools.cache
def _reference(model: str):
    module, data, _ = MODELS[model]
    callbacks = _backbone_callbacks if model == "backbone" else None
    run = Run(module, partial(data, batch_size=GLOBAL_BATCH), None, STEPS, callbacks_factory=callbacks)
    if callbacks is None:
        return result(references({model: run})[model])
    return result(fit_each({model: run}, 1)[model])[0]


@pytest.mark.parametrize("name", [case(name, id=name, slow=name not in QUICK) for name in NAMES])
def test_fine_tuning_trains_like_one_process(name):
    model, _ = name.split("/")
    trained, extras = result(_trained(name not in QUICK)[name])
    assert_same_training(_reference(model), trained, weight_atol=WEIGHT_ATOL)
    for rank, extra in enumerate(extras):
        assert extra["stateful"] > 0 or name.endswith("pp2"), (rank, extra)  # a frozen first stage holds none
        assert extra["stateful_frozen"] == 0, (rank, extra)


def test_lora_adapters_tensor_parallelism_cannot_split_are_refused_by_name():
    """DoRA's magnitude vector (a per-output-feature scale of the whole weight) is not split beside a sharded
    projection: refused before the mesh is used, naming the layer and what works."""
    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel

    module = LoraLM(use_dora=True)
    with pytest.raises(NotImplementedError, match=r"q_proj.*DoRA magnitudes.*use_dora=False"):
        apply_tensor_parallel(module, None, "auto", sequence_parallel=False)
