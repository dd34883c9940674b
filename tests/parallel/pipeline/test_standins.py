"""The stand-ins a pipeline stage puts in place of modules it does not run (one process, no spawn)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel.pipeline.standins import PassThrough, Placeholder, ValueCheck


def test_placeholder_returns_fresh_zeros_shaped_like_the_original_output():
    embedding = nn.Embedding(11, 6)
    placeholder = Placeholder(embedding, ValueCheck())
    assert not list(placeholder.parameters())  # the weights stay with the first stage
    idx = torch.randint(0, 11, (2, 5))
    first = placeholder(idx)
    assert first.shape == embedding(idx).shape and first.dtype == torch.float32 and not first.any()
    assert placeholder(torch.randint(0, 11, (3, 4))).shape == (3, 4, 6)  # another input shape
    first.add_(1.0).requires_grad_()  # what the user's code does with one microbatch's output stays with it
    second = placeholder(idx)
    assert second is not first and not second.any() and not second.requires_grad
    with torch.inference_mode():
        assert not placeholder(idx).any()
    assert not placeholder(idx).is_inference()  # shapes are cached, tensors are not


def test_placeholder_builds_tuple_outputs_afresh_with_their_non_tensor_items():
    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, int]:
            return self.proj(x) * scale, 7

    placeholder = Placeholder(TwoOutputs(), ValueCheck())
    x = torch.randn(2, 4)
    hidden, seven = placeholder(x, scale=2.0)
    assert hidden.shape == (2, 3) and not hidden.any() and seven == 7
    assert placeholder(x, scale=2.0)[0] is not hidden  # a tree output is built afresh each call


def test_pass_through_hands_its_first_input_on():
    x = torch.randn(2, 3)
    assert PassThrough(ValueCheck())(x, torch.zeros(1)) is x
    assert PassThrough(ValueCheck())(hidden_states=x) is x


def test_while_values_are_checked_stand_ins_return_nan_in_place_of_their_values():
    check = ValueCheck(on=True)
    x, idx = torch.randn(2, 3), torch.randint(0, 11, (2, 5))
    passed = PassThrough(check)(x)
    assert passed.shape == x.shape and passed.isnan().all() and not x.isnan().any()
    assert PassThrough(check)(idx) is idx  # integers cannot carry NaN: handed on as they are
    assert Placeholder(nn.Embedding(11, 6), check)(idx).isnan().all()
    check.on = False
    assert PassThrough(check)(x) is x and not Placeholder(nn.Embedding(11, 6), check)(idx).any()


class _LongSkip(nn.Module):
    """Blocks in a ModuleList, the first block's output added to the input of block ``skip_to`` (a U-Net-style
    skip)."""

    def __init__(self, skip_to: int) -> None:
        super().__init__()
        self.skip_to = skip_to
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        skip = x
        for i, block in enumerate(self.blocks):
            if i == self.skip_to:
                x = x + skip
            x = block(x)
            if i == 0:
                skip = x
        return self.head(x)


def _network(name: str) -> tuple[nn.Module, Any, str]:
    """A network, the call a step makes on it, and the block where the split's stage 1 starts."""
    from tests.helpers.modded_nanogpt import GPT
    from tests.helpers.modules import GPT2Module, LlamaModule
    from tests.helpers.nanogpt import GPT as NanoGPT
    from tests.helpers.nanogpt import GPTConfig

    torch.manual_seed(0)
    idx = torch.randint(0, 16, (2, 5))
    if name == "modded-nanogpt":
        return GPT(vocab_size=16, num_layers=4, num_heads=2, model_dim=8), lambda m: m(idx), "blocks.2"
    if name.startswith("long skip"):  # to the stage's second block, or to its first (code at the stage boundary)
        return _LongSkip(skip_to=3 if name.endswith("inside") else 2), lambda m: m(idx), "blocks.2"
    if name == "nanogpt":
        config = GPTConfig(block_size=5, vocab_size=16, n_layer=4, n_head=2, n_embd=8)
        return NanoGPT(config), lambda m: m(idx), "transformer.h.2"
    # Hugging Face as shipped, every layer's hidden state returned too (the stand-ins' among them)
    hf = (LlamaModule if name == "hf-llama" else GPT2Module)(vocab_size=16).model
    start = "model.layers.1" if name == "hf-llama" else "transformer.h.1"
    return hf, lambda m: m(input_ids=idx, output_hidden_states=True), start


REFUSED = ["modded-nanogpt", "long skip inside", "long skip at the boundary"]


@pytest.mark.parametrize("name", [*REFUSED, "nanogpt", "hf-llama", "hf-gpt2"])
def test_a_later_stage_that_computes_with_stand_in_values_is_refused_at_its_first_forward(name):
    """modded-nanogpt's blocks take the embeddings (``x0``, value embeddings) and earlier blocks' outputs (U-Net
    skips); a stage after the first would compute with stand-ins for them and train wrong, whether the skip lands
    inside the stage or right before its first block. nanoGPT and Hugging Face models pass one activation: their
    check passes (hidden states of every layer returned or not), and the checked forward is the stage's forward."""
    from lightning_mgpu.parallel.pipeline.capture import StepCapture
    from lightning_mgpu.parallel.pipeline.plan import plan_split
    from lightning_mgpu.parallel.pipeline.split import PipelineRuntime

    network, call, start = _network(name)
    width = network.get_input_embeddings().weight.shape[1] if name.startswith("hf") else 8
    runtime = PipelineRuntime(network, plan_split(network, 2, [start]), [1], 2)
    runtime.start_step(StepCapture(network, [network]).capture_all([lambda: call(network)]))
    stage = runtime.stages[0]
    received = torch.randn(2, 5, width)
    if name in REFUSED:
        with pytest.raises(RuntimeError, match="an `x0` skip connection"):
            stage(received)
        assert not runtime.value_check.on  # the check is switched off however the forward ended
        return
    checked = stage(received)
    stage.reset()
    assert stage.values_checked and torch.equal(stage(received), checked) and not checked.isnan().any()
    # An activation already holding NaN (an earlier stage diverged) decides nothing: the next forward checks again.
    runtime.stages[0].values_checked = False
    stage.reset()
    stage(torch.full_like(received, float("nan")))
    assert not stage.values_checked
