"""The stand-ins a pipeline stage puts in place of modules it does not run (one process, no spawn)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.parallel.pipeline_standins import PassThrough, Placeholder


def test_placeholder_returns_zeros_shaped_like_the_original_output_and_reuses_them_until_written_into():
    embedding = nn.Embedding(11, 6)
    placeholder = Placeholder(embedding)
    assert not list(placeholder.parameters())  # the weights stay with the first stage
    idx = torch.randint(0, 11, (2, 5))
    first = placeholder(idx)
    assert first.shape == embedding(idx).shape and first.dtype == torch.float32 and not first.any()
    assert placeholder(idx) is first  # no allocation and no fill per microbatch
    assert placeholder(torch.randint(0, 11, (3, 4))).shape == (3, 4, 6)  # another input shape: its own zeros

    first.add_(1.0)  # the user's forward writes into it: handed out no more, and left as the user left it
    second = placeholder(idx)
    assert second is not first and not second.any() and bool((first == 1.0).all())
    assert placeholder(idx) is second


def test_placeholder_zeros_made_under_inference_mode_are_never_handed_to_training():
    placeholder = Placeholder(nn.Embedding(11, 6))
    idx = torch.randint(0, 11, (2, 5))
    with torch.inference_mode():
        evaluated = placeholder(idx)
    assert evaluated.is_inference() and not evaluated.any()
    trained = placeholder(idx)
    assert not trained.is_inference()
    weight = nn.Parameter(torch.ones(6))
    (trained * weight).sum().backward()  # usable by autograd: saved for backward without complaint
    assert weight.grad is not None


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
