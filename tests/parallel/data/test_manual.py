"""Which submodules become FSDP2 units under manual optimization, and the tensors of their outputs followed into
backward (``parallel/data/manual.py``); no processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Categorical, Independent, Normal

from lightning_mgpu.parallel.data.manual import called_units, follow_outputs_into_backward, grad_tensors

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md"


class _GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        self.discriminator = nn.Linear(4, 1)
        self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 3)])  # indexed by the step, never called
        self.activation = nn.ReLU()  # no parameters


def test_each_called_child_with_parameters_is_a_unit_and_containers_are_looked_into():
    module = _GAN()
    units = called_units(module, [module.generator[0]], zero_stage=3)
    assert units == [module.generator, module.discriminator, module.heads[0], module.heads[1]]
    blocks_only = nn.Module()
    blocks_only.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert called_units(blocks_only, [list(blocks_only.layers)], zero_stage=2) == []  # every parameter in a unit


def test_children_sharing_a_parameter_form_one_unit():
    """A head tied to the embedding: one FSDP group for both (FSDP2 refuses a parameter in two groups)."""
    module = nn.Module()
    module.embedding, module.mix, module.head = nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False)
    module.head.weight = module.embedding.weight
    assert called_units(module, [], zero_stage=3) == [[module.embedding, module.head], module.mix]


def test_a_parameter_of_no_called_submodule_is_refused_with_the_message_the_guide_quotes():
    module = _GAN()
    module.scale = nn.Parameter(module.discriminator.weight.detach().clone())
    with pytest.raises(ValueError) as info:
        called_units(module, [], zero_stage=3)
    quoted = f"ValueError: {info.value}"
    assert "scale belong to no submodule that a step calls" in quoted
    assert quoted in GUIDE.read_text(), f"docs/troubleshooting.md does not quote the current message:\n{quoted}"


def _same(found: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return [id(t) for t in found] == [id(t) for t in expected]


def test_tensors_inside_a_distribution_are_found_where_fsdp_does_not_look():
    """PPO's actor output: FSDP2 finds no tensor needing a gradient in ``(Categorical, actions)``; the logits are
    the distribution's attribute (its ``_param`` too: found once), and so are the probabilities ``sample`` computed
    from them (a lazy property, cached in the object)."""
    logits = torch.randn(4, 3, requires_grad=True) * 1
    pi = Categorical(logits=logits)
    seen, inside = grad_tensors((pi, pi.sample()))
    assert seen == [] and _same(inside, [pi.logits, pi.probs])
    normal = Independent(Normal(torch.zeros(2, requires_grad=True) * 1, torch.ones(2)), 1)  # a nested one
    value = torch.ones(2, requires_grad=True) * 2
    seen, inside = grad_tensors({"pi": normal, "value": [value]})
    assert _same(seen, [value]) and _same(inside, [normal.base_dist.loc])


def test_dataclasses_and_plain_objects_are_looked_into_and_modules_are_not():
    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        extra: object

    class Holder:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor
            self.module = nn.Linear(2, 2)  # its parameters are no output

    a, b = (torch.ones(1, requires_grad=True) * k for k in (1, 2))
    seen, inside = grad_tensors(Out(a, Holder(b)))
    assert _same(seen, [a]) and _same(inside, [b])


def test_an_output_with_no_tensor_needing_a_gradient_is_refused_naming_the_unit():
    class Opaque:
        pass

    class Actor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> tuple[Opaque, torch.Tensor]:
            self.net(x)
            return Opaque(), x.detach()

    module = nn.Module()
    module.actor = Actor()
    follow_outputs_into_backward(module, [module.actor], zero_stage=3)
    with torch.no_grad():
        module.actor(torch.ones(1, 2))  # a rollout: nothing to follow
    with pytest.raises(ValueError, match=r"actor returned tuple\(Opaque, Tensor\), in which no tensor that needs"):
        module.actor(torch.ones(1, 2))
