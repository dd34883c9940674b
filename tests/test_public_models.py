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
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers import public_models as pm
from tests.helpers.batched import Run, fit_each, references
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import RandomImageDataModule, RandomTokenDataModule

# The slow tier: published model code (litgpt, torchtitan, timm, Hugging Face) across the basic layouts.
pytestmark = pytest.mark.slow


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
    "timm ResNet-18": (functools.partial(pm.TimmClassifier, "resnet18", sgd=True), _IMAGES),
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
# T5's cross-attention is planned from the decoder blocks' real call and BART's decoder stages receive the
# encoder's output from the first stage (issue 47): both train under tp and pp like the others.
EXPECTED: dict[str, dict[str, str]] = {
    "timm ResNet-18": {"tp 2": _NO_LINEAR, "dp 2 x tp 2 ZeRO-3": _NO_LINEAR},
    "timm ConvNeXt": {"tp 2": _NO_LINEAR, "dp 2 x tp 2 ZeRO-3": _NO_LINEAR},
    "HF T5": {"pp 2": _TUPLE_BLOCKS, "pp 2 x dp 2 ZeRO-1": _TUPLE_BLOCKS},
}
# Layouts a model is not run under, and why (each also shown in the table of docs/guides/public-models.md).
_OWN_TEST = "trains like one process accumulating the same microbatches (BatchNorm: see the test below)"
NOT_RUN: dict[str, dict[str, str]] = {
    "timm ResNet-18": {
        "pp 2": _OWN_TEST,
        "pp 2 x dp 2 ZeRO-1": _OWN_TEST,
    },
}


# The docs' table (docs/guides/public-models.md) says each outcome in a few words.
_IN_SHORT = {
    TRAINS: "✓",
    _NO_LINEAR: "refused: no Linear layer to split",
    _TUPLE_BLOCKS: "refused: blocks hand on a tuple",
    _OWN_TEST: "✓ (over the same microbatches)",
}


def docs_table() -> str:
    """The table of models and layouts in docs/guides/public-models.md, rendered from ``EXPECTED`` and ``NOT_RUN``."""
    lines = [f"| model | {' | '.join(LAYOUTS)} |", f"|---|{'---|' * len(LAYOUTS)}"]
    for model in MODELS:
        cells = [_IN_SHORT.get(expected(model, layout), expected(model, layout)) for layout in LAYOUTS]
        if model in BATCHNORM:  # data parallel: each rank's own batch statistics, as DDP keeps them
            cells = [c + " (as DDP)" if c == "✓" and _dp(*LAYOUTS[lay]) > 1 else c for c, lay in zip(cells, LAYOUTS)]
        lines.append(f"| {model} | {' | '.join(cells)} |")
    return "\n".join(lines)


def test_the_docs_show_this_suite_s_table():
    page = (Path(__file__).parent.parent / "docs" / "guides" / "public-models.md").read_text()
    table = docs_table()
    assert table in page, f"docs/guides/public-models.md must hold the suite's table as rendered:\n{table}"


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


@pytest.mark.parametrize("dp", [1, 2])
def test_batchnorm_under_pipeline_parallelism_matches_accumulating_the_same_microbatches(dp):
    """ResNet-18 under pp 2 (x dp 2 ZeRO-1) with 2 microbatches: losses, weights, running statistics and batch
    counters as one process (as Lightning's DDP at dp 2, each rank keeping its own statistics) accumulating
    gradients over the same microbatches. torch's shape-inference forward must not count."""
    factory, kind = MODELS["timm ResNet-18"]
    strategy = {"pipeline_parallel_size": 2, "num_microbatches": 2, "zero_stage": 1}
    runs = {"pp": Run(factory, _data(kind, GLOBAL_BATCH // dp), strategy, STEPS)}
    pipelined = fit_each(runs, 2 * dp, timeout=600)["pp"]
    accumulate = {"accumulate_grad_batches": 2}
    accumulated = fit_each({"one": Run(factory, _data(kind, GLOBAL_BATCH // dp // 2), None, STEPS, accumulate)}, dp)
    assert not isinstance(pipelined, str), pipelined
    assert not isinstance(accumulated["one"], str), accumulated["one"]
    result, reference = pipelined[0], accumulated["one"][0]
    per_step = torch.tensor(reference.losses, dtype=torch.float64).view(-1, 2).mean(1)
    torch.testing.assert_close(torch.tensor(result.losses, dtype=torch.float64), per_step, rtol=1e-5, atol=0)
    counters = [k for k in reference.state_dict if k.endswith("num_batches_tracked")]
    assert counters and all(int(reference.state_dict[k]) == 2 * STEPS for k in counters)
    for key, value in reference.state_dict.items():  # weights and buffers; the counters exactly (integers)
        torch.testing.assert_close(result.state_dict[key], value, rtol=1e-4, atol=1e-4, msg=lambda m: f"{key}: {m}")


def test_torchtitan_llama_saved_under_tensor_parallelism_resumes_under_pipeline_and_zero3(tmp_path):
    """torchtitan's Llama 3 (blocks in a ModuleDict) saved at step 3 of 6 under tp 2, resumed under pp 2 and under
    dp 2 ZeRO-3: the resumed steps' losses as the uninterrupted run's, and the states loaded equal to those saved."""
    from tests.test_checkpoint import CROSS_LAYOUT_RTOL, SaveAt, _assert_same_states, _losses_match

    factory, kind = MODELS["torchtitan Llama 3"]
    steps = 6
    saved, _ = fit(
        factory, _data(kind, GLOBAL_BATCH), {"tensor_parallel_size": 2}, 2, steps,
        callbacks_factory=lambda: [SaveAt(tmp_path, (3,))],
    )  # fmt: skip
    checkpoint = tmp_path / "step3.ckpt"
    for layout, strategy, dp in (("pp", {"pipeline_parallel_size": 2}, 1), ("zero3", {"zero_stage": 3}, 2)):
        resaved = tmp_path / layout
        resaved.mkdir()
        resumed, _ = fit(
            factory, _data(kind, GLOBAL_BATCH // dp), strategy, 2, steps,
            callbacks_factory=lambda resaved=resaved: [SaveAt(resaved, resave=True)],
            fit_kwargs={"ckpt_path": str(checkpoint)},
        )  # fmt: skip
        _losses_match(saved.losses, resumed.losses, 3, CROSS_LAYOUT_RTOL)
        _assert_same_states(checkpoint, resaved / "resaved.ckpt")


class ReplicatedWeights(L.Callback):
    """At the end of training, each rank's local copy of every parameter that is whole on every rank."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        whole = {}
        for name, param in pl_module.named_parameters():
            if isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements):
                whole[name] = param.to_local().detach().clone()
            elif not isinstance(param, DTensor):
                whole[name] = param.detach().clone()
        self.results["replicated"] = whole


# Models whose defaults have dropout, trained once with it: under tp 2, or dp 2 where tp 2 is refused.
WITH_DROPOUT = {
    "HF GPT-2": (functools.partial(pm.HFCausalLM, "gpt2"), "tp 2"),
    "HF BERT": (functools.partial(pm.HFMaskedLM, "bert"), "tp 2"),
    "HF BART": (functools.partial(pm.HFSeq2SeqLM, "bart"), "tp 2"),
    "HF T5": (functools.partial(pm.HFSeq2SeqLM, "t5"), "dp 2"),
}
DROPOUT_BAND = 0.02  # mean loss over the steps within 2% of one process with dropout (other random masks)


@pytest.mark.parametrize("model", list(WITH_DROPOUT))
def test_default_dropout_trains_within_a_band_and_keeps_replicated_weights_identical(model):
    factory, layout = WITH_DROPOUT[model]
    strategy, devices = LAYOUTS[layout]
    kind = MODELS[model][1]
    data = _data(kind, GLOBAL_BATCH // _dp(strategy, devices))
    run = Run(factory, data, strategy, STEPS, callbacks_factory=lambda: [ReplicatedWeights()])
    outcome = fit_each({"run": run}, devices)
    reference = references({f"{model} with dropout": Run(factory, _data(kind, GLOBAL_BATCH), None, STEPS)})
    result, extras = outcome["run"] if not isinstance(outcome["run"], str) else pytest.fail(outcome["run"])
    expected_losses = reference[f"{model} with dropout"]
    assert not isinstance(expected_losses, str), expected_losses
    mean, expected_mean = sum(result.losses) / STEPS, sum(expected_losses.losses) / STEPS
    assert abs(mean - expected_mean) <= DROPOUT_BAND * expected_mean, (result.losses, expected_losses.losses)
    first, *others = [rank_extras["replicated"] for rank_extras in extras]
    assert first, "no parameter whole on every rank to compare"
    for other in others:
        assert other.keys() == first.keys()
        for name, value in first.items():
            assert torch.equal(other[name], value), f"{name} differs between ranks after {STEPS} steps"


def test_gpt2_with_its_default_config_under_tp4_and_pp2_x_tp2():
    """GPT-2 as ``GPT2Config()`` gives it (``use_cache=True``, tied embeddings), dropout 0: the cache lives inside
    tensor-parallel attention at tp 4 and inside pipeline stages at pp 2 x tp 2."""
    factory, kind = MODELS["HF GPT-2"]
    layouts = {
        "tp 4": {"tensor_parallel_size": 4},
        "pp 2 x tp 2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    }
    outcomes = fit_each({n: Run(factory, _data(kind, GLOBAL_BATCH), s, STEPS) for n, s in layouts.items()}, 4)
    for name, outcome in outcomes.items():
        assert not isinstance(outcome, str), f"{name}:\n{outcome}"
        assert_same_training(_reference("HF GPT-2"), outcome[0], weight_atol=WEIGHT_ATOL)


def test_explicit_pipeline_split_names_blocks_of_a_module_dict():
    """torchtitan's Llama 3 keeps its blocks in an ``nn.ModuleDict`` keyed "0", "1", ...: ``pipeline_split`` names
    them as ``named_modules`` does, here an uneven split of 3 blocks (1 + 2); a name that is not a block is refused
    before training with the names that are."""
    _, kind = MODELS["torchtitan Llama 3"]
    factory = functools.partial(pm.TorchTitanLlama, n_layers=3)
    split = {"pipeline_parallel_size": 2, "pipeline_split": ["model.layers.1"]}
    wrong = {"pipeline_parallel_size": 2, "pipeline_split": ["model.layers.7"]}
    data = _data(kind, GLOBAL_BATCH)
    (reference,) = references({"one process": Run(factory, data, None, STEPS)}).values()
    assert not isinstance(reference, str), reference
    outcomes = fit_each({"split": Run(factory, data, split, STEPS), "wrong": Run(factory, data, wrong, STEPS)}, 2)
    assert not isinstance(outcomes["split"], str), outcomes["split"]
    assert_same_training(reference, outcomes["split"][0], weight_atol=WEIGHT_ATOL)
    assert isinstance(outcomes["wrong"], str), "a split at a block that does not exist trained"
    assert re.search(r"model\.layers\.7.*model\.layers\.0", outcomes["wrong"], re.DOTALL), outcomes["wrong"]
