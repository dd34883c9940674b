"""Positional reads of safetensors slices: every slice shape equals the tensor's own slice, read into place."""

from __future__ import annotations

import itertools

import torch
from safetensors.torch import save_file

from lightning_mgpu.checkpoint.hf_reader import SafetensorsFile


def test_slices_of_every_shape_equal_the_stored_tensors_slices(tmp_path):
    stored = {
        "cube": torch.randn(5, 7, 3),
        "scalar": torch.tensor(3.5),
        "half": torch.randn(4).bfloat16(),
        "ints": torch.arange(12, dtype=torch.int64).view(3, 4),
    }
    save_file(stored, tmp_path / "weights.safetensors")
    file = SafetensorsFile(str(tmp_path / "weights.safetensors"))
    assert torch.equal(file.read("scalar", ()), stored["scalar"])
    assert torch.equal(file.read("half", (slice(1, 3),)), stored["half"][1:3])
    for box in itertools.product(
        [slice(0, 5), slice(1, 4), slice(2, 3)], [slice(0, 7), slice(2, 6)], [slice(0, 3), slice(1, 2)]
    ):
        assert torch.equal(file.read("cube", box), stored["cube"][box]), box
    into = torch.empty(2, 4, dtype=torch.int64)
    assert file.read("ints", (slice(1, 3), slice(0, 4)), into=into) is into  # read in place
    assert torch.equal(into, stored["ints"][1:3])
    into = torch.empty(2, 4, dtype=torch.float64)  # another type: read, then converted by the caller
    assert file.read("ints", (slice(1, 3), slice(0, 4)), into=into) is not into
