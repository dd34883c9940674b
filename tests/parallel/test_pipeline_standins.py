"""The stand-ins a pipeline stage puts in place of modules it does not run (one process, no spawn)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.parallel.pipeline_standins import PassThrough, Placeholder


def test_placeholder_returns_fresh_zeros_shaped_like_the_original_output():
    embedding = nn.Embedding(11, 6)
    placeholder = Placeholder(embedding)
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

    placeholder = Placeholder(TwoOutputs())
    x = torch.randn(2, 4)
    hidden, seven = placeholder(x, scale=2.0)
    assert hidden.shape == (2, 3) and not hidden.any() and seven == 7
    assert placeholder(x, scale=2.0)[0] is not hidden  # a tree output is built afresh each call


def test_pass_through_hands_its_first_input_on():
    x = torch.randn(2, 3)
    assert PassThrough()(x, torch.zeros(1)) is x
    assert PassThrough()(hidden_states=x) is x
