"""torch's own Transformer modules under pipeline parallelism: ``nn.Transformer`` (Lightning's demo
``LightningTransformer`` as published) and ``nn.TransformerEncoder``, trained like one process.

Two things these modules need of a stage: their containers read their first layer (``nn.TransformerEncoder`` and
``nn.TransformerDecoder`` look at ``self.layers[0].self_attn.batch_first``), which may be another stage's block
(its stand-in answers from a meta-device copy), and the decoder's blocks cross-attend to the encoder's output, which
only the first stage computes (it is sent beside the activation: ``pipeline/carry.py``).
"""

from __future__ import annotations

import functools
from functools import partial

import pytest
import torch
from lightning.pytorch.demos.transformer import Transformer
from torch import nn

from lightning_mgpu.parallel.pipeline.capture import StepCapture
from lightning_mgpu.parallel.pipeline.plan import plan_split
from lightning_mgpu.parallel.pipeline.split import PipelineRuntime
from lightning_mgpu.parallel.pipeline.standins import PassThrough, ValueCheck
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.equivalence import assert_same_training
from tests.helpers.tiers import case
from tests.helpers.torch_transformers import VOCAB, DemoTransformer, TorchEncoderLM, demo_data, encoder_data

# The demo's optimizer, SGD at lr 0.1, turns rounding differences (microbatch gradients summed in another order)
# into diverging runs after ~5 steps (x10 per step, measured: 2e-7 at step 3, 3e-3 at step 9): 4 steps are compared,
# as for the published models (tests/test_public_models.py).
DEMO_STEPS, STEPS = 4, 10
# The key bias of torch's attention has no gradient in exact arithmetic (softmax ignores a shift of the scores);
# AdamW turns its rounding-noise gradient into lr-sized steps whatever the layout (measured 1.01e-4 after 10 steps).
KEY_BIAS_ATOL = {f"encoder.layers.{i}.self_attn.in_proj_bias": 1e-3 for i in range(2)}


def test_a_stand_in_answers_what_its_container_reads_of_the_block():
    layer = nn.TransformerDecoderLayer(16, 2, 32, batch_first=True)
    standin = PassThrough(ValueCheck(), layer)
    assert standin.self_attn.batch_first is True and standin.norm_first is False
    assert not list(standin.parameters()) and standin.self_attn.in_proj_weight.is_meta  # nothing of its weights
    with pytest.raises(AttributeError):
        _ = standin.not_an_attribute


def _stage_after_the_first(network: nn.Module, call, start: str) -> PipelineRuntime:
    runtime = PipelineRuntime(network, plan_split(network, 2, [start]), [1], 2)
    runtime.start_step(StepCapture(network, [network]).capture_all([lambda: call(network)]))
    return runtime


def test_a_later_stage_finds_what_its_blocks_take_from_the_first_stage():
    """Stage 1 of the demo's decoder cross-attends to the encoder's output (the memory), which it must receive; an
    encoder-only model's stage takes nothing but the activation, so nothing more is sent."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 7))
    demo = Transformer(vocab_size=VOCAB, dropout=0.0)
    runtime = _stage_after_the_first(demo, lambda m: m(tokens, tokens), "transformer.decoder.layers.1")
    assert runtime.discover_carried(runtime.stages[0]) == {("transformer.encoder", 0, 0)}
    encoder = TorchEncoderLM()
    runtime = _stage_after_the_first(encoder, lambda m: m(tokens), "encoder.layers.1")
    assert runtime.discover_carried(runtime.stages[0]) == set()


PP2 = {"pipeline_parallel_size": 2}
MODELS = {  # factory, data, global batch (the demo's: two of the published loader's one-sequence batches), steps
    "demo": (DemoTransformer, demo_data, 2, DEMO_STEPS),
    "demo, 4 layers": (partial(DemoTransformer, nlayers=4), demo_data, 2, DEMO_STEPS),
    "encoder LM": (TorchEncoderLM, encoder_data, 8, STEPS),
}
LOOPED, V = {**PP2, "pipeline_schedule": "Interleaved1F1B"}, {**PP2, "pipeline_schedule": "ZBVZeroBubble"}
LAYOUTS = [  # (name, model, strategy, devices, slow)
    ("demo pp2", "demo", PP2, 2, False),
    # Stages 1 and 2 hand the memory on (received, sent again) as well as cross-attending to it.
    ("demo pp2 looped", "demo, 4 layers", LOOPED, 2, False),
    ("encoder LM pp2", "encoder LM", PP2, 2, False),
    ("demo pp2 V", "demo, 4 layers", V, 2, True),  # the V's last stage beside the first: their rank holds the encoder
    ("demo pp2 x dp2 ZeRO-1", "demo", {**PP2, "zero_stage": 1}, 4, True),
    # Heads of every attention sharded (tp_plan="auto", read from the decoder blocks' call) and the memory sent.
    ("demo pp2 x tp2", "demo", {**PP2, "tensor_parallel_size": 2}, 4, True),
]


@functools.cache
def _trained(slow: bool) -> dict:
    """The tier's runs (one job per world size)."""
    by_devices: dict[int, dict[str, Run]] = {}
    for name, model, strategy, devices, in_slow in LAYOUTS:
        if in_slow == slow:
            factory, data, batch, steps = MODELS[model]
            dp = devices // strategy["pipeline_parallel_size"] // strategy.get("tensor_parallel_size", 1)
            by_devices.setdefault(devices, {})[name] = Run(factory, partial(data, batch // dp), strategy, steps)
    return {n: r for devices, runs in by_devices.items() for n, r in fit_each(runs, devices, 900).items()}


@functools.cache
def _references() -> dict:
    runs = {
        model: Run(factory, partial(data, batch), None, steps)
        for model, (factory, data, batch, steps) in MODELS.items()
    }
    return references(runs)


@pytest.mark.parametrize(
    ("name", "model", "slow"), [case(name, model, slow, id=name, slow=slow) for name, model, _, _, slow in LAYOUTS]
)
def test_torch_transformers_train_like_one_process_under_pipeline_parallelism(name, model, slow):
    trained, _ = result(_trained(slow)[name])
    assert_same_training(result(_references()[model]), trained, weight_atol=1e-4, weight_atols=KEY_BIAS_ATOL)
