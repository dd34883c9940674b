"""``tp_plan="auto"`` derived from a block's real call inside the model's forward (issue 47, item 5), and torch's own
Transformer modules under it (item 4).

A block that takes more than hidden states (torchtitan's Llama 3 blocks take the rotary frequencies, T5's decoder
blocks the encoder's output and position biases, ``nn.TransformerDecoderLayer`` the memory) cannot be run alone; its
call inside the user's step on one batch shows what each projection reads. The models are the packages' own, built
as ``tests/helpers/public_models.py`` builds them (their defaults, sizes shrunk, dropout 0 for the comparisons).
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_mgpu.parallel.example import ExampleStep
from lightning_mgpu.parallel.tensor.derive import derive_block_plan
from lightning_mgpu.parallel.tensor.plan import _block_rules, auto_plan
from tests.helpers import public_models as pm
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.equivalence import assert_same_training
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.torch_transformers import VOCAB, DemoTransformer, TorchEncoderLM, demo_data, encoder_data

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")


def _step_on(module: L.LightningModule, length: int = 8) -> ExampleStep:
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, VOCAB, (2, length), generator=g), torch.randint(0, VOCAB, (2, length), generator=g))
    return ExampleStep(module, "training_step", lambda: batch)


def _t5() -> pm.HFSeq2SeqLM:
    return pm.HFSeq2SeqLM("t5", dropout=0.0)


# ------------------------------------------------------------------------------------------------ derivation
def test_torchtitan_llama_blocks_are_derived_from_their_call_as_the_name_rules_shard_them():
    """torchtitan's ``TransformerBlock.forward(x, freqs_cis, ...)`` cannot run on hidden states alone; in its real
    call the data flow gives the plan the name rules (wq/wk/wv/wo, w1/w2/w3) give, without reading a name."""
    module = pm.TorchTitanLlama()
    with pytest.raises(ValueError, match=r"was not available .* on hidden states of width 64 alone failed"):
        derive_block_plan(module, "model.layers")
    assert derive_block_plan(module, "model.layers", _step_on(module)) == _block_rules(module, "model.layers")


T5_CROSS_ATTENTION = {
    **{f"model.decoder.block.*.layer.1.EncDecAttention.{name}": "colwise" for name in "qkv"},
    "model.decoder.block.*.layer.1.EncDecAttention.o": "rowwise",
}


def test_t5_cross_attention_is_sharded_from_its_call_with_the_encoder_output():
    """T5's cross-attention reads its keys and values from the encoder's output, an argument of the decoder block:
    column-parallel like the queries, and the output projection row-parallel (the attention's position bias and mask
    are arguments too). On hidden states alone they are never reached and the plan is refused."""
    module = _t5()
    with pytest.raises(ValueError, match=r"EncDecAttention.q: not reached in a run on hidden states"):
        auto_plan(module)
    plan = auto_plan(module, example=_step_on(module))
    assert plan.items() >= T5_CROSS_ATTENTION.items() and set(plan.values()) == {"colwise", "rowwise"}


def test_pretrained_weights_on_the_meta_device_are_planned_from_a_meta_batch():
    """Under ``pretrained=`` the model is parallelized before its weights exist: the step runs on the meta device."""
    with torch.device("meta"):
        module = _t5()
    assert auto_plan(module, example=_step_on(module)).items() >= T5_CROSS_ATTENTION.items()


DEMO_PLAN = {
    "model.transformer.decoder.layers.*.self_attn": "multihead_attention",
    "model.transformer.decoder.layers.*.multihead_attn": "multihead_attention",
    "model.transformer.decoder.layers.*.linear1": "colwise",
    "model.transformer.decoder.layers.*.linear2": "rowwise",
}


def test_torch_transformer_layers_shard_their_attention_by_heads():
    """``nn.TransformerDecoderLayer`` needs the memory (its call gives it); ``nn.TransformerEncoderLayer`` runs on
    hidden states alone. Each ``nn.MultiheadAttention`` is sharded whole by heads, the feed-forward Megatron-style."""
    demo = DemoTransformer()
    with pytest.raises(ValueError, match=r"missing 1 required positional argument: 'memory'"):
        auto_plan(demo)
    assert auto_plan(demo, example=_step_on(demo, 35)) == DEMO_PLAN
    encoder = {glob.replace("model.transformer.decoder", "encoder"): s for glob, s in DEMO_PLAN.items()}
    del encoder["encoder.layers.*.multihead_attn"]
    assert auto_plan(TorchEncoderLM()) == encoder


def test_the_step_changes_nothing_and_one_that_cannot_run_leaves_the_hidden_states_trace():
    """The demo's forward keeps the masks and positional table it makes (``self.src_mask``, ``pe``) and the
    random numbers stay as they were: the step leaves no trace. A step that cannot run before training (manual
    optimization asks for its optimizers) is reported beside the hidden-states run's failure."""
    demo = DemoTransformer()
    state = torch.random.get_rng_state()
    auto_plan(demo, example=_step_on(demo, 35))
    assert demo.model.src_mask is None and demo.model.pos_encoder.pe is None
    assert torch.equal(state, torch.random.get_rng_state())

    class Manual(DemoTransformer):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.optimizers()  # no trainer before training: raises
            super().training_step(batch, batch_idx)

    manual = Manual()
    with pytest.raises(ValueError, match=r"running the training step on one batch .* failed \(.*\), and running"):
        auto_plan(manual, example=_step_on(manual, 35))


# ------------------------------------------------------------------------------------------------ training
class _Sharded(L.Callback):
    """The parameters tensor parallelism split, as training starts."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results["sharded"] = {
            name
            for name, p in pl_module.named_parameters()
            if isinstance(p, DTensor) and not all(placement.is_replicate() for placement in p.placements)
        }


def _tokens(batch: int) -> RandomTokenDataModule:
    return RandomTokenDataModule(vocab_size=pm.VOCAB, seq_len=pm.SEQUENCE, batch_size=batch)


STEPS = {"demo": 4}  # SGD at lr 0.1 (the demo's): see tests/parallel/pipeline/test_torch_transformer.py
MODELS = {  # factory, data, the parameters tp 2 must split (a sample)
    "torchtitan Llama 3": (pm.TorchTitanLlama, functools.partial(_tokens, 8), {"model.layers.1.attention.wq.weight"}),
    "HF T5": (_t5, functools.partial(_tokens, 8), {"model.decoder.block.1.layer.1.EncDecAttention.k.weight"}),
    "demo": (
        DemoTransformer,
        functools.partial(demo_data, 2),
        {"model.transformer.decoder.layers.1.multihead_attn.in_proj_weight"},
    ),
    "encoder LM": (TorchEncoderLM, functools.partial(encoder_data, 8), {"encoder.layers.0.self_attn.out_proj.weight"}),
}
# AdamW turns rounding noise on gradients that are zero in exact arithmetic into lr-sized steps: torch attention's
# key bias (softmax ignores a shift of the scores).
KEY_BIAS_ATOL = {f"encoder.layers.{i}.self_attn.in_proj_bias": 1e-3 for i in range(2)}


@functools.cache
def _runs() -> dict[str, Any]:
    runs = {
        name: Run(
            factory, data, {"tensor_parallel_size": 2}, STEPS.get(name, 10), callbacks_factory=lambda: [_Sharded()]
        )
        for name, (factory, data, _) in MODELS.items()
    }
    return fit_each(runs, 2, 900)


@functools.cache
def _references() -> dict[str, Any]:
    return references(
        {name: Run(factory, data, None, STEPS.get(name, 10)) for name, (factory, data, _) in MODELS.items()}
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_plans_from_the_real_call_train_like_one_process(name):
    trained, _ = result(_runs()[name])
    assert_same_training(result(_references()[name]), trained, weight_atol=1e-4, weight_atols=KEY_BIAS_ATOL)
    assert trained.extra["sharded"] >= MODELS[name][2], sorted(trained.extra["sharded"])


def test_what_the_step_changes_before_its_network_call_is_put_back():
    """Code a step runs before the network call (a metric updated, a counter kept, a list appended to) leaves no
    trace of the run that reads the blocks' call."""
    from torchmetrics.aggregation import SumMetric

    class Counting(DemoTransformer):
        def __init__(self) -> None:
            super().__init__()
            self.seen = SumMetric()
            self.calls: list[int] = []
            self.register_buffer("steps", torch.zeros(()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.update(batch[0].numel())
            self.calls.append(batch_idx)
            self.steps += 1
            return super().training_step(batch, batch_idx)

    module = Counting()
    auto_plan(module, example=_step_on(module, 35))
    assert module.calls == [] and int(module.steps) == 0 and int(module.seen.compute()) == 0
