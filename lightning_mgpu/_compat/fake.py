"""Tensors without data and a view of every operator they run (checked on torch 2.13.0).

- ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes, dtypes and devices but no storage;
  unlike the meta device, FSDP2, DTensor and DDP run a whole step on them (torch's own ``torch.compile`` and
  torchtitan's dry runs use it). No public module exports it.
- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): sees every aten and ``c10d`` operator call, with its
  arguments, below autograd; torch documents it in "Extending PyTorch" but exports it from a private module only.
"""

from __future__ import annotations

from typing import Any

from lightning_mgpu._compat import internal

FakeTensorMode: Any = internal("torch._subclasses.fake_tensor", "FakeTensorMode")
TorchDispatchMode: Any = internal("torch.utils._python_dispatch", "TorchDispatchMode")
