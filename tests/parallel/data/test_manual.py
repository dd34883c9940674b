"""Which submodules become FSDP2 units under manual optimization (``parallel/data/manual.py``); no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from lightning_mgpu.parallel.data.manual import called_units

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
