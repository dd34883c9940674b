"""A weight tied across pipeline stages (LM head = token embedding) stays one weight and trains like one process."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import GPT2Module, RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule
from tests.helpers.probes import MetricRecorder
from tests.helpers.tiers import case

GLOBAL_BATCH = 8
STEPS = 10
WEIGHT_ATOL = 1e-4
TRAINER = {"limit_val_batches": 2, "val_check_interval": 5, "num_sanity_val_steps": 1}
TIED = {  # model: (factory, the two names of the tied weight)
    "nanogpt": (NanoGPTModule, ("model.transformer.wte.weight", "model.lm_head.weight")),
    "gpt2": (lambda: GPT2Module(tie_word_embeddings=True), ("model.transformer.wte.weight", "model.lm_head.weight")),
}


def _data(batch: int):
    return RandomTokenDataModule(batch_size=batch, with_val=True)


_references: dict = {}


def _check(model: str, strategy: dict, devices: int, dp: int = 1, trainer_kwargs: dict = TRAINER) -> None:
    factory, (embedding, head) = TIED[model]
    key = (model, tuple(sorted(trainer_kwargs.items())))
    if key not in _references:
        _references[key] = fit(
            factory,
            lambda: _data(GLOBAL_BATCH),
            None,
            1,
            STEPS,
            trainer_kwargs=trainer_kwargs,
            callbacks_factory=lambda: [MetricRecorder()],
        )
    reference, reference_extras = _references[key]
    assert torch.equal(reference.state_dict[embedding], reference.state_dict[head])  # really tied
    result, extras = fit(
        factory,
        lambda: _data(GLOBAL_BATCH // dp),
        strategy,
        devices,
        STEPS,
        trainer_kwargs=trainer_kwargs,
        callbacks_factory=lambda: [MetricRecorder()],
    )
    assert_same_training(reference, result, weight_atol=WEIGHT_ATOL)
    # The copies on the first and the last stage are gathered from their own ranks: they must still be equal.
    assert torch.equal(result.state_dict[embedding], result.state_dict[head])
    torch.testing.assert_close(
        torch.tensor(extras[0]["val_losses"]), torch.tensor(reference_extras[0]["val_losses"]), rtol=1e-5, atol=0
    )


LAYOUTS = [  # (model, strategy, devices, dp)
    ("nanogpt", {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B"}, 2, 1),
    ("nanogpt", {"pipeline_parallel_size": 2, "pipeline_schedule": "GPipe"}, 2, 1),
    ("nanogpt", {"pipeline_parallel_size": 2, "zero_stage": 1}, 4, 2),
    ("nanogpt", {"pipeline_parallel_size": 2, "zero_stage": 3}, 4, 2),
    ("nanogpt", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, 1),
    ("nanogpt", {"pipeline_parallel_size": 4, "num_microbatches": 4}, 4, 1),  # the tie spans ranks 0 and 3 only
    ("gpt2", {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B"}, 2, 1),
    ("gpt2", {"pipeline_parallel_size": 2, "pipeline_schedule": "GPipe"}, 2, 1),
    ("gpt2", {"pipeline_parallel_size": 2, "zero_stage": 1}, 4, 2),
    ("gpt2", {"pipeline_parallel_size": 2, "zero_stage": 3}, 4, 2),
    ("gpt2", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, 1),
    ("nanogpt", {"pipeline_parallel_size": 2, "pipeline_schedule": "Interleaved1F1B", "num_microbatches": 4}, 2, 1),
    # V schedules put the first and the last stage on one rank: one Parameter, used by two stages of one rank.
    ("nanogpt", {"pipeline_parallel_size": 2, "pipeline_schedule": "ZBVZeroBubble", "num_microbatches": 4}, 2, 1),
    (
        "nanogpt",
        {"pipeline_parallel_size": 2, "pipeline_schedule": "DualPipeV", "num_microbatches": 4, "zero_stage": 1},
        4,
        2,
    ),
    (
        "nanogpt",
        {"pipeline_parallel_size": 2, "pipeline_schedule": "ZBVZeroBubble", "num_microbatches": 4, "zero_stage": 3},
        4,
        2,
    ),
]


def _layout_case(model: str, strategy: dict, devices: int, dp: int):
    """The slow tier: GPT-2's layouts that repeat nanoGPT's, but for pp 2 x tp 2 (its tie meets the vocabulary
    split)."""
    slow = model == "gpt2" and "tensor_parallel_size" not in strategy
    test_id = f"{model}-" + "-".join(f"{k[0]}{v}" for k, v in strategy.items())
    return case(model, strategy, devices, dp, id=test_id, slow=slow)


@pytest.mark.parametrize(("model", "strategy", "devices", "dp"), [_layout_case(*layout) for layout in LAYOUTS])
def test_tied_weights_across_stages_train_like_one_process(model, strategy, devices, dp):
    _check(model, strategy, devices, dp)


def test_clipping_counts_a_tied_weight_once_and_accumulation_sums_it_once():
    trainer_kwargs = {**TRAINER, "gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
    _check("gpt2", {"pipeline_parallel_size": 2}, 2, trainer_kwargs=trainer_kwargs)


ROUND_TRIPS = [  # (save layout, devices, dp) -> (resume layout, devices, dp)
    (({"pipeline_parallel_size": 2}, 2, 1), ({}, 1, 1)),
    (({}, 1, 1), ({"pipeline_parallel_size": 2, "zero_stage": 1}, 4, 2)),
]


@pytest.mark.parametrize(("saved", "resumed"), ROUND_TRIPS, ids=["pp2-to-1proc", "1proc-to-pp2dp2z1"])
def test_checkpoints_of_a_tied_weight_move_between_layouts(tmp_path, saved, resumed):
    from tests.test_checkpoint import SaveAt, _losses_match

    factory, (embedding, head) = TIED["nanogpt"]
    key = ("nanogpt-6", ())
    if key not in _references:
        _references[key] = fit(factory, lambda: _data(GLOBAL_BATCH), None, 1, 6)
    reference = _references[key][0]
    (save_kwargs, save_devices, save_dp), (resume_kwargs, resume_devices, resume_dp) = saved, resumed
    fit(
        factory,
        lambda: _data(GLOBAL_BATCH // save_dp),
        save_kwargs,
        save_devices,
        3,
        callbacks_factory=lambda: [SaveAt(tmp_path, steps=(3,))],
    )
    second, _ = fit(
        factory,
        lambda: _data(GLOBAL_BATCH // resume_dp),
        resume_kwargs,
        resume_devices,
        6,
        fit_kwargs={"ckpt_path": str(tmp_path / "step3.ckpt")},
    )
    _losses_match(reference.losses, second.losses, 3, 1e-5)
    assert torch.equal(second.state_dict[embedding], second.state_dict[head])
