"""What plain per-rank tensors need (the modules of a Hugging Face model get them, see ``tensor.py``).

- A row-parallel output is handed back as a tensor that model code may modify in place (``_OwnedLocal``).
- A parameter left replicated but applied to this rank's shard of a column-parallel output (Apertus' xIELU
  ``alpha_p``/``alpha_n`` on the MLP's intermediate, a per-head ``q_norm`` that a plan does not name) only sees the
  rank's part of the activations: its gradient is a partial sum. ``watch_shard_parameters`` sums it over the
  tensor-parallel group, as Hugging Face's ``replicated_with_grad_allreduce`` does for the modules a plan names,
  for every such module whether the plan names it or not. Which calls read a shard is seen at run time: a
  column-parallel output (or a view of it) is marked, so a module of the same attention/MLP that reads the block's
  replicated input (a latent-attention down-projection, its norm) is left alone.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

_SHARD_MARK = "_lightning_mgpu_rank_shard"


class _OwnedLocal(torch.autograd.Function):
    """A row-parallel output's reduced DTensor -> its local tensor as a fresh autograd output, not a view.

    ``DTensor.to_local()`` returns a view made inside a custom Function, which autograd forbids modifying in place;
    model code does modify a block's output in place (Llama 4's MoE: ``out = shared_expert(x); out.add_(routed)``).
    The DTensor here is the transient result of the all-reduce that nothing else holds, so its local tensor can be
    handed out as it is, without a copy. The gradient flows back in the DTensor's own layout.
    """

    @staticmethod
    def forward(ctx: Any, dtensor: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = dtensor._spec
        local = dtensor._local_tensor
        return local.wait() if isinstance(local, AsyncCollectiveTensor) else local

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        return DTensor.from_local(grad, ctx.spec.mesh, ctx.spec.placements, run_check=False)


def owned_local(outputs: DTensor) -> torch.Tensor:
    return _OwnedLocal.apply(outputs)


def _root(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._base if tensor._base is not None else tensor


def marking_shards(output_fn: Callable) -> Callable:
    """A column-parallel projection's output function that marks its plain output (this rank's shard), so that the
    modules reading it can be recognised."""

    def marked(module: nn.Module, outputs: Any, device_mesh: DeviceMesh) -> Any:
        output = output_fn(module, outputs, device_mesh)
        if torch.is_tensor(output) and not isinstance(output, DTensor):
            setattr(_root(output), _SHARD_MARK, True)
        return output

    return marked


def _reads_shard(args: tuple, kwargs: dict) -> bool:
    return any(torch.is_tensor(a) and not isinstance(a, DTensor) and getattr(_root(a), _SHARD_MARK, False)
               for a in (*args, *kwargs.values()))


class _ShardParameters:
    """Forward pre-hook of a module with plain parameters inside a tensor-parallel attention/MLP: when it reads a
    rank's shard, its parameters' gradients are summed over ``mesh`` (before accumulation, so gradient accumulation
    and data-parallel reduction see the full gradient)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        reduced = funcol.all_reduce(grad, "sum", self.mesh)
        return reduced.wait() if isinstance(reduced, AsyncCollectiveTensor) else reduced

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or not _reads_shard(args, kwargs):
            return
        for param in module.parameters(recurse=False):
            # Checked at each call: module.to() and FSDP2's unsharded parameters are new tensors without the hook.
            armed = (param._backward_hooks or {}).values()
            if param.requires_grad and not isinstance(param, DTensor) and self._sum not in armed:
                param.register_hook(self._sum)


def watch_shard_parameters(module: nn.Module, regions: list[str], sharded: set[str],
                           mesh: DeviceMesh) -> list[str]:
    """Arm ``_ShardParameters`` on the modules under ``regions`` (attention/MLP modules of Hugging Face models that
    hold column- and row-parallel projections) that have plain parameters of their own and are not ``sharded``."""
    hook = _ShardParameters(mesh)
    watched = []
    for region in regions:
        for name, child in module.get_submodule(region).named_modules(prefix=region):
            if name in sharded or not any(not isinstance(p, DTensor) for p in child.parameters(recurse=False)):
                continue
            child.register_forward_pre_hook(hook, with_kwargs=True)
            watched.append(name)
    return watched
