"""``HybridStrategy(compile=True)``: each block compiled (inductor's C++ backend on CPU) after tensor parallelism
and checkpointing, before the pipeline's and data parallelism's wraps, trains like the uncompiled one process."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest

from tests.helpers import public_models as pm
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.equivalence import assert_same_training
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule

pytestmark = pytest.mark.slow  # the slow tier: torch.compile's first compilations of every block


STEPS = 10
GLOBAL_BATCH = 8
COMPILED_RTOL = 1e-4  # inductor fuses and reorders the blocks' float ops
MODELS = {
    "nanoGPT": functools.partial(NanoGPTModule, n_layer=2),
    "HF Llama": functools.partial(pm.HFCausalLM, "llama", dropout=0.0),
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp 2 ZeRO-3": {"zero_stage": 3},
    "tp 2": {"tensor_parallel_size": 2},
    "pp 2 1F1B": {"pipeline_parallel_size": 2},
}


def _data(batch: int, samples: int = 64) -> Any:
    return functools.partial(
        RandomTokenDataModule, vocab_size=pm.VOCAB, seq_len=32, batch_size=batch, num_samples=samples
    )


class Compilations(L.Callback):
    """Graphs dynamo compiled in this rank during this fit (``torch._dynamo``'s own counter, which counts every
    fit of the job's process)."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self._before = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch._dynamo.utils import counters

        self._before = counters["stats"]["unique_graphs"]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch._dynamo.utils import counters

        self.results["graphs"] = counters["stats"]["unique_graphs"] - self._before


_outcomes: dict[str, Any] = {}


def _trained() -> dict[str, Any]:
    if not _outcomes:
        runs = {
            f"{model} {layout}": Run(
                factory, _data(GLOBAL_BATCH // (2 if "dp" in layout else 1)), {**strategy, "compile": True}, STEPS,
                callbacks_factory=lambda: [Compilations()],
            )
            for model, factory in MODELS.items()
            for layout, strategy in LAYOUTS.items()
        }  # fmt: skip
        # 44 samples in batches of 8: the fifth step's batch holds 4 (ragged), then a new epoch.
        runs["ragged"] = Run(MODELS["nanoGPT"], _data(4, samples=44), {"zero_stage": 3, "compile": True}, STEPS,
                             callbacks_factory=lambda: [Compilations()])  # fmt: skip
        _outcomes.update(fit_each(runs, 2, timeout=1500))
    return _outcomes


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_compiled_blocks_train_like_the_uncompiled_one_process(model, layout):
    (reference,) = references({model: Run(MODELS[model], _data(GLOBAL_BATCH), None, STEPS)}).values()
    trained, extras = result(_trained()[f"{model} {layout}"])
    assert_same_training(result(reference), trained, loss_rtol=COMPILED_RTOL, weight_atol=COMPILED_RTOL)
    assert all(extra["graphs"] >= 1 for extra in extras), extras  # something was compiled


def test_a_ragged_last_batch_recompiles_once():
    """A batch of another size compiles one more graph (with the batch dimension dynamic); the epochs after it
    reuse both: two graphs per block class over 10 steps, forward (backward graphs are not dynamo's)."""
    _, extras = result(_trained()["ragged"])
    for extra in extras:
        assert 1 <= extra["graphs"] <= 2, extras
