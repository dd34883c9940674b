"""c10d and pipelining internals the monitor wraps to time communication (checked on torch 2.13.0).

- ``functional_collectives()``: ``torch.distributed._functional_collectives``, the module DTensor, FSDP2 and
  tensor parallelism issue their collectives through; there is no public module with these functions.
- ``all_reduce``: ``_functional_collectives.all_reduce`` over a mesh, waited on (its ``AsyncCollectiveTensor``
  unwrapped). Looked up at each call, so the monitor's timing wrapper sees it as it sees DTensor's own.
- ``group_name``: ``_functional_collectives._resolve_group_name``, the name of a group given in any of the forms
  those functions accept.
- ``pipelining_p2p()``: the module and function name (``schedules._batch_p2p``) torch's pipeline schedules send and
  receive through; the public ``dist.batch_isend_irecv`` is called inside it with no group to attribute.
- ``FUNCTIONAL_OPS``: the ``torch.ops._c10d_functional`` namespace (collectives as graph ops, what selective
  activation checkpointing recognises); None where it does not exist.
- ``default_store()``: ``distributed_c10d._get_default_store``, the key-value store of the default process group
  (no public accessor): ranks that failed agree through it, without a collective, on what their teardown may do.
- ``fake_store()``: ``torch.testing._internal.distributed.fake_pg.FakeStore``, the store torch's own fake-backend
  dry runs (torchtitan's ``--comm.mode fake_backend``) initialize the ``"fake"`` process group with: its
  rendezvous returns at once for any world size, where a real store would wait for every rank.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_mgpu._compat import changed

if TYPE_CHECKING:
    from torch._ops import _OpNamespace
    from torch.distributed import ProcessGroup, Store


def functional_collectives() -> ModuleType:
    import torch.distributed._functional_collectives as funcol

    return funcol


def fake_store() -> Store:
    """A store for ``init_process_group("fake", ...)`` that needs no other rank (see the module docstring)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as error:
        raise AttributeError(changed("fake_pg.FakeStore", "torch", str(error))) from error
    return FakeStore()


def all_to_all(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Equal chunks of dim 0 exchanged within ``group``, differentiable (the backward is the reverse exchange)."""
    funcol = functional_collectives()
    exchanged = funcol.all_to_all_single_autograd(tensor, None, None, group)
    return exchanged.wait() if isinstance(exchanged, funcol.AsyncCollectiveTensor) else exchanged


def all_reduce(tensor: torch.Tensor, op: str, mesh: DeviceMesh) -> torch.Tensor:
    """``tensor`` reduced with ``op`` (``"sum"``, ...) over ``mesh`` (a 1-D DeviceMesh or a group), waited on."""
    funcol = functional_collectives()
    reduced = funcol.all_reduce(tensor, op, mesh)
    return reduced.wait() if isinstance(reduced, funcol.AsyncCollectiveTensor) else reduced


def group_name(group: object) -> str:  # what functional collectives take: a group, a mesh, ranks, a name
    return str(functional_collectives()._resolve_group_name(group))


def pipelining_p2p() -> tuple[ModuleType, str] | None:
    """``(module, name)`` of the function torch's schedules batch their sends and receives through, if any."""
    from torch.distributed.pipelining import schedules

    return (schedules, "_batch_p2p") if hasattr(schedules, "_batch_p2p") else None


FUNCTIONAL_OPS: _OpNamespace | None = getattr(torch.ops, "_c10d_functional", None)


def default_store() -> Store:
    """The default process group's ``Store`` (``add``, ``compare_set``, ...)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
