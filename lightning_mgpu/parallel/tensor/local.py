"""What plain per-rank tensors need (the modules of a Hugging Face model get them, see ``apply.py``).

- A row-parallel output is handed back as a tensor that model code may modify in place (``owned_local``).
- A parameter left replicated but applied to this rank's shard of a column-parallel output (Apertus' xIELU
  ``alpha_p``/``alpha_n`` on the MLP's intermediate, a per-head ``q_norm`` that a plan does not name) only sees the
  rank's part of the activations: its gradient is a partial sum. ``watch_shard_parameters`` sums it over the
  tensor-parallel group, as Hugging Face's ``replicated_with_grad_allreduce`` does for the modules a plan names,
  for every such module whether the plan names it or not. Which calls read a shard is seen at run time: a
  column-parallel output (or a view of it) is marked, so a module of the same attention/MLP that reads the block's
  replicated input (a latent-attention down-projection, its norm) is left alone.
- A module whose parameters span the whole width of what it reads a shard of (ESMC's q/k LayerNorm over all heads)
  runs on the gathered input and hands on this rank's shard of its output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_mgpu._compat import c10d, dtensor
from lightning_mgpu._compat.tensors import has_backward_hook, view_base

_SHARD_MARK = "_lightning_mgpu_rank_shard"


def owned_local(outputs: DTensor) -> torch.Tensor:
    """A row-parallel output's reduced DTensor -> its local tensor as a fresh autograd output, not a view.

    ``DTensor.to_local()`` returns a view made inside a custom Function, which autograd forbids modifying in place;
    model code does modify a block's output in place (Llama 4's MoE: ``out = shared_expert(x); out.add_(routed)``).
    The DTensor here is the transient result of the all-reduce that nothing else holds, so its local tensor can be
    handed out as it is, without a copy (``_compat.dtensor.owned_local``). The gradient flows back in the DTensor's
    own layout.
    """
    return dtensor.owned_local(outputs)


def marking_shards(output_fn: Callable) -> Callable:
    """A column-parallel projection's output function that marks its plain output (this rank's shard), so that the
    modules reading it can be recognised."""

    def marked(module: nn.Module, outputs: object, device_mesh: DeviceMesh) -> Any:
        output = output_fn(module, outputs, device_mesh)
        if torch.is_tensor(output) and not isinstance(output, DTensor):
            setattr(view_base(output), _SHARD_MARK, True)
        return output

    return marked


def _shard_read(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The first argument that is this rank's shard of a column-parallel output (or a view of one), if any."""
    for a in (*args, *kwargs.values()):
        if torch.is_tensor(a) and not isinstance(a, DTensor) and getattr(view_base(a), _SHARD_MARK, False):
            return a
    return None


def _spans_all_shards(module: nn.Module, shard: torch.Tensor, tp: int) -> bool:
    """Whether ``module``'s parameters are as wide as the whole of what ``shard`` is one part of (ESMC's q/k
    LayerNorm over the full ``num_heads * head_dim`` applied to the q_proj output)."""
    params = list(module.parameters(recurse=False))
    return (
        bool(params)
        and shard.dim() > 0
        and all(p.dim() > 0 and p.shape[-1] == shard.shape[-1] * tp != shard.shape[-1] for p in params)
    )


class _ShardParameters:
    """Forward hooks of a module with plain parameters inside a tensor-parallel attention/MLP, for its calls on a
    rank's shard.

    - Parameters as wide as the shard: its gradients are partial sums, summed over ``mesh`` (before accumulation,
      so gradient accumulation and data-parallel reduction see the full gradient).
    - Parameters as wide as all the shards together (a norm over the full width): the module runs on the gathered
      input, and its output, as wide, is handed on as this rank's shard again. Every rank then computes the same
      full module, so its gradients are whole (no sum); backward all-gathers the output's gradient.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._gathered: list[int] = []  # per call in flight: the gathered width, 0 for none

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        return c10d.all_reduce(grad, "sum", self.mesh)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        shard = _shard_read(args, kwargs)
        if shard is not None and _spans_all_shards(module, shard, self.mesh.size()):
            sharded = DTensor.from_local(shard, self.mesh, [Shard(-1)], run_check=False)
            full = sharded.redistribute(placements=[Replicate()]).to_local()
            self._gathered.append(full.shape[-1])
            swap = {id(shard): full}
            return (tuple(swap.get(id(a), a) for a in args), {k: swap.get(id(v), v) for k, v in kwargs.items()})
        self._gathered.append(0)
        if shard is None or not torch.is_grad_enabled():
            return None
        for param in module.parameters(recurse=False):
            # Checked at each call: module.to() and FSDP2's unsharded parameters are new tensors without the hook.
            if param.requires_grad and not isinstance(param, DTensor) and not has_backward_hook(param, self._sum):
                param.register_hook(self._sum)
        return None

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> Any:
        width = self._gathered.pop() if self._gathered else 0
        if not width or not torch.is_tensor(output) or output.shape[-1] != width:
            return None
        replicated = DTensor.from_local(output, self.mesh, [Replicate()], run_check=False)
        output = replicated.redistribute(placements=[Shard(-1)]).to_local()
        setattr(view_base(output), _SHARD_MARK, True)
        return output


def watch_shard_parameters(module: nn.Module, regions: list[str], sharded: set[str], mesh: DeviceMesh) -> list[str]:
    """Arm ``_ShardParameters`` on the modules under ``regions`` (attention/MLP modules of Hugging Face models that
    hold column- and row-parallel projections) that have plain parameters of their own and are not ``sharded``."""
    hook = _ShardParameters(mesh)
    watched = []
    for region in regions:
        for name, child in module.get_submodule(region).named_modules(prefix=region):
            if name in sharded or not any(not isinstance(p, DTensor) for p in child.parameters(recurse=False)):
                continue
            child.register_forward_pre_hook(hook.before, with_kwargs=True)
            child.register_forward_hook(hook.after, with_kwargs=True, always_call=True)
            watched.append(name)
    return watched
