"""Public model code as its packages publish it, under every basic layout: trains like one process, or is refused.

Each model (``tests/helpers/public_models.py``: package defaults, sizes shrunk, dropout 0 for the comparisons) is
wrapped in the LightningModule a user would write and trained for ``STEPS`` steps under each layout of ``LAYOUTS``.
Every case ends in exactly one of what ``EXPECTED`` says:

- ``TRAINS``: per-step losses within ``LOSS_RTOL`` (1e-5) relative and every parameter and buffer within
  ``WEIGHT_ATOL`` (1e-4) of the same model trained on one process (integer buffers exactly);
- a refusal: the run raises before any optimizer step, with a message matching the pattern, which names the reason
  and the fix.

A crash, a mismatch or a refusal with another message fails the case. BatchNorm models under data parallelism are
compared with Lightning's own ``DDPStrategy`` at the same data-parallel size (statistics per rank, as DDP keeps
them), and under pipeline parallelism with one process accumulating the same microbatches (``test_batchnorm_...``).

Cost: a job per model and world size (its layouts trained one after the other in the same forked ranks), the
one-process references in one job.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from tests.helpers import public_models as pm
from tests.helpers.batched import Run, fit_each, references
from tests.helpers.equivalence import assert_same_training
from tests.helpers.modules import RandomImageDataModule, RandomTokenDataModule

STEPS = 4
GLOBAL_BATCH = 8
WEIGHT_ATOL = 1e-4  # the bound: AdamW turns reduction-order noise on near-zero gradients into ~1e-5 steps
TRAINS = "trains like one process"

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "dp 2": ({"zero_stage": 0}, 2),
    "dp 2 ZeRO-3": ({"zero_stage": 3}, 2),
    "tp 2": ({"tensor_parallel_size": 2}, 2),
    "pp 2": ({"pipeline_parallel_size": 2}, 2),
    "dp 2 x tp 2 ZeRO-3": ({"tensor_parallel_size": 2, "zero_stage": 3}, 4),
    "pp 2 x dp 2 ZeRO-1": ({"pipeline_parallel_size": 2, "zero_stage": 1}, 4),
}

_TOKENS, _IMAGES = "tokens", "images"
MODELS: dict[str, tuple[Any, str]] = {
    "litgpt GPT": (functools.partial(pm.LitGPTModule), _TOKENS),
    "litgpt GPT, grouped-query": (functools.partial(pm.LitGPTModule, n_query_groups=2), _TOKENS),
    "torchtitan Llama 3": (functools.partial(pm.TorchTitanLlama), _TOKENS),
    "timm ViT": (
        functools.partial(
            pm.TimmClassifier, "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4
        ),
        _IMAGES,
    ),
    "timm ResNet-18": (functools.partial(pm.TimmClassifier, "resnet18"), _IMAGES),
    "timm ConvNeXt": (functools.partial(pm.TimmClassifier, "convnext_atto"), _IMAGES),
    "HF GPT-2": (functools.partial(pm.HFCausalLM, "gpt2", dropout=0.0), _TOKENS),
    "HF Llama": (functools.partial(pm.HFCausalLM, "llama", dropout=0.0), _TOKENS),
    "HF Qwen3-MoE": (functools.partial(pm.HFCausalLM, "qwen3_moe", dropout=0.0), _TOKENS),
    "HF BERT": (functools.partial(pm.HFMaskedLM, "bert", dropout=0.0), _TOKENS),
    "HF T5": (functools.partial(pm.HFSeq2SeqLM, "t5", dropout=0.0), _TOKENS),
    "HF BART": (functools.partial(pm.HFSeq2SeqLM, "bart", dropout=0.0), _TOKENS),
}
BATCHNORM = {"timm ResNet-18"}

# What each case must end in; a layout not named trains like one process.
_NO_LINEAR = r"found no Linear layers to shard.*Train it with data parallelism \(zero_stage\) or pipeline parallelism"
_TUPLE_BLOCKS = r"returns tuple of .* rather than one tensor.*Use pipeline_parallel_size=1"
_STANDINS = r"computes with values that only other stages compute.*Use pipeline_parallel_size=1"
_CROSS_ATTENTION = r"cannot tell how to shard these layers.*EncDecAttention.*Pass `tp_plan` as a dict"
_DECODER_CROSS = r"cannot tell how to shard these layers.*encoder_attn.*Pass `tp_plan` as a dict"
EXPECTED: dict[str, dict[str, str]] = {
    "timm ResNet-18": {"tp 2": _NO_LINEAR, "dp 2 x tp 2 ZeRO-3": _NO_LINEAR},
    "timm ConvNeXt": {"tp 2": _NO_LINEAR, "dp 2 x tp 2 ZeRO-3": _NO_LINEAR},
    "HF T5": {
        "tp 2": _CROSS_ATTENTION,
        "dp 2 x tp 2 ZeRO-3": _CROSS_ATTENTION,
        "pp 2": _TUPLE_BLOCKS,
        "pp 2 x dp 2 ZeRO-1": _TUPLE_BLOCKS,
    },
    "HF BART": {"pp 2": _STANDINS, "pp 2 x dp 2 ZeRO-1": _STANDINS},
}
# Layouts a model is not run under, and why (each also shown in the README's table).
_OWN_TEST = "trains like one process accumulating the same microbatches (BatchNorm: see the test below)"
NOT_RUN: dict[str, dict[str, str]] = {
    "timm ResNet-18": {
        "pp 2": _OWN_TEST,
        "pp 2 x dp 2 ZeRO-1": "not run: BatchNorm statistics per microbatch and rank match neither one process nor DDP",
    },
}


def expected(model: str, layout: str) -> str:
    return NOT_RUN.get(model, {}).get(layout) or EXPECTED.get(model, {}).get(layout, TRAINS)


def _data(kind: str, batch: int) -> Any:
    if kind == _IMAGES:
        return functools.partial(RandomImageDataModule, size=pm.IMAGE, batch_size=batch)
    return functools.partial(RandomTokenDataModule, vocab_size=pm.VOCAB, seq_len=pm.SEQUENCE, batch_size=batch)


def _dp(strategy: dict[str, Any], devices: int) -> int:
    return devices // strategy.get("tensor_parallel_size", 1) // strategy.get("pipeline_parallel_size", 1)


_outcomes: dict[tuple[str, int], dict[str, Any]] = {}


def _outcomes_of(model: str, world: int) -> dict[str, Any]:
    """Every layout of ``world`` ranks for ``model``, trained in one job (memoized for the session)."""
    if (model, world) not in _outcomes:
        factory, kind = MODELS[model]
        runs = {}
        for layout, (strategy, devices) in LAYOUTS.items():
            if devices == world and layout not in NOT_RUN.get(model, {}):
                runs[layout] = Run(factory, _data(kind, GLOBAL_BATCH // _dp(strategy, devices)), strategy, STEPS)
        if model in BATCHNORM:  # the reference under data parallelism: Lightning's DDP, statistics per rank
            runs["DDP"] = Run(factory, _data(kind, GLOBAL_BATCH // world), None, STEPS)
        _outcomes[(model, world)] = fit_each(runs, world, timeout=900) if runs else {}
    return _outcomes[(model, world)]


_references: dict[str, Any] = {}


def _reference(model: str) -> Any:
    if not _references:
        runs = {name: Run(factory, _data(kind, GLOBAL_BATCH), None, STEPS) for name, (factory, kind) in MODELS.items()}
        _references.update(references(runs, timeout=900))
    outcome = _references[model]
    if isinstance(outcome, str):
        raise AssertionError(f"the one-process reference of {model} failed:\n{outcome}")
    return outcome


CASES = [(model, layout) for model in MODELS for layout in LAYOUTS if layout not in NOT_RUN.get(model, {})]


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{layout}" for m, layout in CASES])
def test_public_model_trains_like_one_process_or_is_refused(model, layout):
    strategy, devices = LAYOUTS[layout]
    outcome = _outcomes_of(model, devices)[layout]
    want = expected(model, layout)
    if want != TRAINS:
        assert isinstance(outcome, str), f"{model} under {layout} trained; expected a refusal matching {want!r}"
        assert re.search(want, outcome, re.DOTALL), f"{model} under {layout}: not the expected refusal:\n{outcome}"
        return
    assert not isinstance(outcome, str), f"{model} under {layout} failed:\n{outcome}"
    result = outcome[0]
    if model in BATCHNORM and _dp(strategy, devices) > 1:
        reference = _outcomes_of(model, devices)["DDP"]
        assert not isinstance(reference, str), reference
        reference = reference[0]
    else:
        reference = _reference(model)
    assert_same_training(reference, result, weight_atol=WEIGHT_ATOL)


def test_batchnorm_statistics_under_pipeline_parallelism_match_one_process_over_the_same_microbatches():
    """ResNet-18 under pp 2 with 2 microbatches: running statistics and batch counters as one process accumulating
    gradients over the same two half batches (torch's shape-inference forward must not count)."""
    factory, kind = MODELS["timm ResNet-18"]
    runs = {"pp": Run(factory, _data(kind, GLOBAL_BATCH), {"pipeline_parallel_size": 2, "num_microbatches": 2}, STEPS)}
    pipelined = fit_each(runs, 2, timeout=600)["pp"]
    accumulated = fit_each(
        {"one": Run(factory, _data(kind, GLOBAL_BATCH // 2), None, STEPS, {"accumulate_grad_batches": 2})}, 1
    )["one"]
    assert not isinstance(pipelined, str), pipelined
    assert not isinstance(accumulated, str), accumulated
    result, reference = pipelined[0], accumulated[0]
    per_step = torch.tensor(reference.losses, dtype=torch.float64).view(-1, 2).mean(1)
    torch.testing.assert_close(torch.tensor(result.losses, dtype=torch.float64), per_step, rtol=1e-5, atol=0)
    counters = [k for k in reference.state_dict if k.endswith("num_batches_tracked")]
    assert counters and all(int(reference.state_dict[k]) == 2 * STEPS for k in counters)
    for key, value in reference.state_dict.items():
        if "running" in key or key in counters:
            torch.testing.assert_close(result.state_dict[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
