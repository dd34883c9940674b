"""DTensor, DeviceMesh and tensor-parallel style internals (checked on torch 2.13.0).

- ``StridedShard``: ``torch.distributed.tensor.placement_types._StridedShard``. No public placement describes a
  fused ``[q | k | v]`` weight sharded chunk by chunk; torch's own FSDP2 + TP composition uses this one.
- ``StyleHooks``: a custom ``ParallelStyle`` must implement the private ``_apply`` (torch documents no public
  extension point), and the Colwise/Rowwise input and output conversions are private static methods
  (``_prepare_input_fn``/``_prepare_output_fn``). The mixin exposes them as ``apply_style``/``prepare_input``/
  ``prepare_output``.
- ``owned_local``: ``DTensor._spec``/``_local_tensor`` (and ``torch.autograd.Function``, whose metaclass sets the
  private ``_backward_cls`` on every subclass). The public ``DTensor.to_local()`` returns a view made inside a
  custom Function, which autograd forbids modifying in place; this hands out the same local tensor as a fresh
  autograd output (no copy), its gradient flowing back in the DTensor's own layout.
- ``forget_meshes``: ``torch._C._clear_DTensor_sharding_propagator_cache`` (the C++ dispatch cache),
  ``DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear`` and
  ``torch.distributed.tensor._redistribute.clear_redistribute_planner_cache``. DTensor caches its sharding
  decisions by mesh shape and ranks, not by mesh object: a process that builds a second mesh of the same shape
  (the rehearsal's step pass) is otherwise handed output specs holding the first mesh, and its collectives run on
  the first mesh's process groups. No public way.
- ``local_box``: ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, where a rank's shard
  starts in the whole tensor (reading a converted checkpoint entry into it). DTensor has no public accessor.
- ``equal_over_mesh``: ``DTensor._op_dispatcher._custom_op_handlers`` (how torch's own ``loss_parallel`` replaces
  ops). torch's ``aten.equal`` of two DTensors all-reduces its answer over the *world* group, not the tensors' mesh:
  where ranks outside the mesh compare other tensors, or fewer (each pipeline stage holds its own layers; Lightning's
  ``BaseFinetuning`` compares each unfrozen parameter with the optimizer's), the collectives pair up wrongly and the
  run hangs until the timeout. The replacement agrees over the tensors' mesh only.
- ``unflatten_mesh``: ``DeviceMesh._unflatten``, splitting one named mesh dimension into several. The public
  alternative, building a new mesh with ``init_device_mesh``, creates new process groups for every axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mgpu._compat import changed, internal
from lightning_mgpu._compat.c10d import functional_collectives

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement, _StridedShard
    from typing_extensions import TypeIs

StridedShard: type[_StridedShard] = internal("torch.distributed.tensor.placement_types", "_StridedShard")


def strided_shard(dim: int, chunks: int) -> _StridedShard:
    """Shard ``dim`` chunk by chunk: each of ``chunks`` equal chunks is sharded over the mesh dimension."""
    return StridedShard(dim, split_factor=chunks)


def is_strided_shard(placement: Placement) -> TypeIs[_StridedShard]:
    return isinstance(placement, StridedShard)


def strided_chunks(placement: Placement) -> int:
    """The number of chunks a ``StridedShard`` splits its dimension into (1 for any other placement)."""
    return cast(int, placement.split_factor) if isinstance(placement, StridedShard) else 1


class StyleHooks:
    """Mix in before a torch ``ParallelStyle``: its private hooks under public names.

    ``apply_style`` is torch's ``_apply`` (override it; ``super().apply_style`` runs the torch style's own).
    ``prepare_input``/``prepare_output`` are Colwise/RowwiseParallel's input and output conversions with this
    style's layouts: the ``input_fn``/``output_fn`` that ``distribute_module`` takes.
    """

    # The torch style's settings these hooks read (set by its __init__; Any: each torch style infers its own tuple
    # types for them, which a declaration here would have to match in every style it mixes into).
    input_layouts: Any
    desired_input_layouts: Any
    output_layouts: Any
    use_local_output: bool

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self.apply_style(module, device_mesh)

    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return super()._apply(module, device_mesh)  # type: ignore[misc]

    def prepare_input(self, module: nn.Module, inputs: tuple[object, ...], device_mesh: DeviceMesh) -> DTensor:
        return self._prepare_input_fn(  # type: ignore[attr-defined]
            self.input_layouts, self.desired_input_layouts, module, inputs, device_mesh
        )

    # Any: an `output_fn` for `distribute_module`, which declares its hooks as returning None (and uses what they
    # return).
    def prepare_output(self, module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
        return self._prepare_output_fn(  # type: ignore[attr-defined]
            self.output_layouts, self.use_local_output, module, outputs, device_mesh
        )


class _OwnedLocal(torch.autograd.Function):
    """A DTensor -> its local tensor as a fresh autograd output, not a view; backward: the gradient as a DTensor
    of the same mesh and placements."""

    @staticmethod
    def forward(ctx: Any, dtensor: DTensor) -> torch.Tensor:
        ctx.spec = dtensor._spec
        local = dtensor._local_tensor
        waitable = functional_collectives().AsyncCollectiveTensor
        return local.wait() if isinstance(local, waitable) else local

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:
        return DTensor.from_local(grad, ctx.spec.mesh, ctx.spec.placements, run_check=False)


def owned_local(dtensor: DTensor) -> torch.Tensor:
    """``dtensor``'s local tensor (waited on), that the caller may modify in place. Only for a DTensor nothing
    else holds (a collective's transient result): the local tensor is handed out as it is, without a copy."""
    return _OwnedLocal.apply(dtensor)


def unflatten_mesh(mesh: DeviceMesh, dim_name: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with its dimension ``dim_name`` split into ``names`` of ``sizes`` (a view sharing the groups)."""
    unflatten = getattr(mesh, "_unflatten", None)
    if unflatten is None:
        raise AttributeError(changed("DeviceMesh._unflatten", "torch", "the method is gone"))
    return unflatten(dim_name, sizes, names)


def flatten_mesh(mesh: DeviceMesh, dim_names: tuple[str, ...], name: str) -> DeviceMesh:
    """The dimensions ``dim_names`` of ``mesh`` as one dimension ``name``, sliceable from the root mesh afterwards
    (``root[name]``): one process group for all of them."""
    flatten = getattr(mesh[dim_names], "_flatten", None)
    if flatten is None:
        raise AttributeError(changed("DeviceMesh._flatten", "torch", "the method is gone"))
    return flatten(name)


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans (see the module docstring)."""
    internal("torch._C", "_clear_DTensor_sharding_propagator_cache")()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    internal("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache")()


def local_box(tensor: DTensor) -> tuple[int, ...]:
    """Where this rank's shard of ``tensor`` starts in the whole tensor, per dimension."""
    compute = internal("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    _, offsets = compute(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offsets)


def equal_over_mesh() -> Callable[[], None]:
    """``torch.equal`` of DTensors agreed over their own mesh, not the world; returns the undo."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    equal = torch.ops.aten.equal.default
    before = handlers.get(equal)
    handlers[equal] = _equal_over_mesh

    def undo() -> None:
        if before is None:
            handlers.pop(equal, None)
        else:
            handlers[equal] = before

    return undo


def _equal_over_mesh(op_call: OpOverload, args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    first, second = args[0], args[1]
    if not (isinstance(first, DTensor) and isinstance(second, DTensor)):
        message = "got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor"
        raise RuntimeError(f"{op_call}: {message}")
    # Global shapes and meshes are the same on every rank of the mesh: no collective decides these.
    if first.shape != second.shape or first.dtype != second.dtype or first.device_mesh != second.device_mesh:
        return False
    if first.placements != second.placements:
        second = second.redistribute(first.device_mesh, first.placements)
    mesh = first.device_mesh
    agreed = torch.tensor(int(torch.equal(first.to_local(), second.to_local())), device=mesh.device_type)
    for dim in range(mesh.ndim):
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    return bool(agreed.item())
