"""Data parallelism and ZeRO stages 0-3 on torch's FSDP2 machinery.

One mechanism serves every stage, so gradient accumulation, mixed precision and checkpoints behave alike:

- stage 0: parameters replicated, gradients all-reduced. Where nothing needs FSDP2 (plain parameters, no pipeline,
  no casting or offloading) this is torch's ``DistributedDataParallel`` (composable ``replicate``: in place), whose
  C++ reducer all-reduces gradients in buckets while backward still runs; otherwise FSDP2's ``replicate``.
- stage 1: stage 0 plus optimizer states sharded: each data-parallel rank steps only the parameters it owns
  and broadcasts them to its peers afterwards (the ZeroRedundancyOptimizer scheme, applied to the user's own
  optimizer object so that param groups and LR schedulers keep working). Under DDP, gradients are *reduced* to
  their owner only (a DDP communication hook, per bucket and owner): with the broadcast that is 2(dp-1)/dp x 4N
  bytes per rank and step, the reduce-scatter + all-gather volume, instead of all-reduce + broadcast's 3(dp-1)/dp.
- stage 2: ``fully_shard(reshard_after_forward=False)``: gradients and optimizer states sharded; parameters are
  gathered once per step and kept through backward.
- stage 3: ``fully_shard(reshard_after_forward=True)``: parameters sharded too, gathered per block when needed.

At stages 2 and 3 on gloo, gradients are reduce-scattered with an all-to-all and parameters gathered with one
broadcast per rank (``gloo_comms.py``): gloo's own reduce-scatter is an all-reduce of the whole gradient, twice the
traffic and ~2x the CPU, and its all-gather copies the whole output once more.

Blocks (the model's repeated layers) are wrapped one by one so their collectives overlap with compute and only
one block's parameters are unsharded at a time; the root wrap takes every remaining parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mgpu._compat.dtensor import is_strided_shard
from lightning_mgpu._compat.fsdp import is_ddp_replicated, replicate_ddp, replicate_with_fsdp
from lightning_mgpu.layout import DP_AXIS, DP_CP_AXIS, DP_SHARD_AXIS
from lightning_mgpu.parallel.blocks import find_blocks
from lightning_mgpu.parallel.data.buffers import broadcast_buffers_like_ddp, note_gradient_sync
from lightning_mgpu.parallel.data.gloo_comms import use_gloo_comms
from lightning_mgpu.parallel.data.manual import called_units, follow_outputs_into_backward, reduce_in_step_only
from lightning_mgpu.parallel.data.unused_params import watch_trainable, watch_unused_parameters
from lightning_mgpu.parallel.local_step import install_step

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from lightning_mgpu.patches import PatchLog


def apply(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    root: nn.Module | None = None,
    blocks: list[nn.Module] | None = None,
    reshard_blocks: bool | None = None,
    find_unused_parameters: bool | None = None,
    hybrid_mesh: DeviceMesh | None = None,
    manual_optimization: bool = False,
) -> None:
    """Wrap ``module`` in place for data parallelism over ``dp_mesh`` at the given ZeRO stage.

    ``hybrid_mesh``: hybrid sharding (HSDP), the ``(dp_replicate, dp_shard)`` view of ``dp_mesh``. ZeRO-2/3 then
    shard over ``dp_shard`` and replicate over ``dp_replicate`` (``fully_shard`` on the 2-D mesh: gradients
    reduce-scattered in the shard group, then all-reduced across replicas); ZeRO-1 all-reduces gradients over all
    of ``dp_mesh`` and its optimizer states split over ``dp_shard`` (``OptimizerStateSharding``).

    ``blocks`` defaults to the model's repeated blocks (with pipelining: only this rank's).
    Its blocks get a wrap each; ``root`` (default: ``module`` itself), which must contain ``module``, takes the
    remaining parameters. The strategy passes a module that is called exactly once per step, so that the
    LightningModule's own nested ``self(x)`` calls do not end the root's forward early (FSDP2 would then reshard
    the root and gather it again in backward).

    ``reshard_blocks`` overrides ZeRO-3's reshard-after-forward for blocks (a pipeline schedule that gathers and
    frees whole stages itself turns it off).

    ``mp_policy`` (FSDP2 ``MixedPrecisionPolicy``) and ``offload_policy`` (``OffloadPolicy``/``CPUOffloadPolicy``)
    pass through to FSDP2 unchanged. ``find_unused_parameters`` applies where DDP replicates (stages 0-1 of plain
    parameters): see ``parallel/data/unused_params.py``; FSDP2 reduces every gradient anyway.

    ``manual_optimization``: ``manual_backward`` runs inside the root's forward, so under FSDP2 every submodule a
    step calls becomes a unit and the root holds no parameter, and DDP expects no backward after the forward
    (``parallel/data/manual.py``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": hybrid_mesh if hybrid_mesh is not None and zero_stage >= 2 else dp_mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    root = module if root is None else root
    if zero_stage <= 1 and _plain_data_parallel(root, blocks, mp_policy, offload_policy):
        # Under HSDP a parameter's owners are one rank per replica: gradients are all-reduced, not reduced to one.
        owner_reduce = zero_stage == 1 and hybrid_mesh is None
        _replicate_with_ddp(root, dp_mesh, owner_reduce, find_unused_parameters)
        if manual_optimization:
            reduce_in_step_only(root)
        broadcast_buffers_like_ddp(root, dp_mesh.get_group())
        return
    wrap: Callable[..., object]
    if zero_stage <= 1:
        wrap = replicate_with_fsdp
    else:
        wrap = fully_shard
        kwargs["reshard_after_forward"] = (
            zero_stage == 3 if reshard_blocks is None else reshard_blocks and zero_stage == 3
        )
        kwargs["shard_placement_fn"] = _shard_dim_beside_tensor_parallel
    units: list[Any] = find_blocks(module) if blocks is None else blocks
    if zero_stage == 2 and blocks is None:
        # ZeRO-2 keeps every parameter gathered from forward to the end of backward: a unit per block only adds
        # collectives and hooks. Units of consecutive blocks of about DDP's bucket size keep the reduce-scatters
        # overlapped with backward; blocks that fill no bucket go to the root (outside a pipeline, whose stages
        # are freed as a whole).
        units = _bucketed(units, UNIT_BYTES)
    if manual_optimization:
        called = called_units(module, units, zero_stage)
        follow_outputs_into_backward(module, called, zero_stage)
        units = [*units, *called]
    for unit in units:
        wrap(unit, **kwargs)
    if zero_stage >= 2:
        # The root's parameters (embeddings, head, norms) are needed first in backward: keep them gathered.
        kwargs["reshard_after_forward"] = False
    wrap(root, **kwargs)
    for unit in [*units, root] if zero_stage >= 2 else ():
        use_gloo_comms(unit)  # on gloo: an all-to-all reduce-scatter, a broadcast all-gather
    broadcast_buffers_like_ddp(root, dp_mesh.get_group())


UNIT_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def sharded_by_user(module: nn.Module, zero_stage: int, pipeline_parallel_size: int) -> bool:
    """Whether the user's ``configure_model`` applied ``fully_shard`` itself (a module written for Lightning's
    ModelParallelStrategy): the strategy then leaves the data-parallel wrap to it. Refused where that cannot be
    right: another ZeRO stage asked for, a pipeline (which splits the module after ``configure_model``), or
    trainable parameters outside the user's ``fully_shard`` (their gradients would not be averaged)."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in module.modules()):
        return False
    fix = "or remove fully_shard from configure_model and let HybridStrategy shard (zero_stage=3)"
    if pipeline_parallel_size > 1:
        raise NotImplementedError(
            f"configure_model applied fully_shard, but pipeline_parallel_size={pipeline_parallel_size} splits the"
            f" module into stages after it. Use pipeline_parallel_size=1, {fix}."
        )
    if zero_stage != 3:
        raise ValueError(
            f"configure_model applied fully_shard (ZeRO-3 over the data-parallel ranks) itself, but zero_stage="
            f"{zero_stage}. Set zero_stage=3 (the strategy then leaves the wrap to your fully_shard), {fix}."
        )
    outside = [name for name, p in module.named_parameters() if p.requires_grad and not _data_sharded(p)]
    if outside:
        raise ValueError(
            f"configure_model applied fully_shard to part of the module only: {outside[:4]} are outside it, and"
            " their gradients would not be averaged over the data-parallel ranks. Also fully_shard the module"
            f" holding them (the root: Lightning's ModelParallelStrategy examples do), {fix}."
        )
    return True


def _data_sharded(param: nn.Parameter) -> bool:
    """A parameter ``fully_shard`` manages: a DTensor with a data-parallel dimension."""
    if not isinstance(param, DTensor):
        return False
    return bool({DP_AXIS, DP_CP_AXIS, DP_SHARD_AXIS} & set(param.device_mesh.mesh_dim_names or ()))


def _bucketed(blocks: list[nn.Module], cap_bytes: int) -> list[list[nn.Module]]:
    """Consecutive blocks grouped until a group holds ``cap_bytes`` of parameters; the last, smaller rest is left
    out."""
    groups: list[list[nn.Module]] = [[]]
    size = 0
    for block in blocks:
        groups[-1].append(block)
        size += sum(p.numel() * p.element_size() for p in block.parameters())
        if size >= cap_bytes:
            groups.append([])
            size = 0
    return groups[:-1]


def _plain_data_parallel(
    root: nn.Module,
    blocks: list[nn.Module] | None,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
) -> bool:
    """Whether DDP can replicate ``root``: no pipeline stage, no offload, no tensor-parallel (DTensor) weight and no
    FSDP2 mixed-precision setting (``param_dtype``, ``reduce_dtype``, ``output_dtype``), which DDP would ignore."""
    casts = any(getattr(mp_policy, name, None) is not None for name in ("param_dtype", "reduce_dtype", "output_dtype"))
    if blocks is not None or offload_policy is not None or casts:
        return False
    return not any(isinstance(p, DTensor) for p in root.parameters())


def _replicate_with_ddp(root: nn.Module, dp_mesh: DeviceMesh, owner_reduce: bool, find_unused: bool | None) -> None:
    """Torch's DDP applied in place: bucketed all-reduces that start while backward still runs.

    Gradients are views into the buckets (no copy). DDP builds its reducer on the first forward. ``find_unused``:
    whether DDP searches each step for parameters left without a gradient; None decides from the first step
    (``parallel/data/unused_params.py``).
    """
    kwargs = {
        "process_group": dp_mesh.get_group(),
        "gradient_as_bucket_view": True,
        "find_unused_parameters": find_unused is not False,
    }
    replicate_ddp(root, **kwargs)
    comm_hook = None
    if owner_reduce:
        # ZeRO-1: set before DDP's first forward builds the reducer; owners come with the optimizers
        # (OptimizerStateSharding).
        reduce = _OwnerReduce(dp_mesh.get_group())
        comm_hook = (reduce, _reduce_to_owners)
        cast(Any, root).register_comm_hook(*comm_hook)  # a method replicate_ddp gave its class
        root._lightning_mgpu_owner_reduce = reduce  # type: ignore[assignment]
    if find_unused is not True:
        watch_unused_parameters(root, dp_mesh.get_group(), kwargs, comm_hook)
    watch_trainable(root, kwargs, comm_hook)  # registered last, so it runs first: before the search records


def _shard_dim_beside_tensor_parallel(param: nn.Parameter) -> Any | None:
    """Shard a fused (strided) tensor-parallel weight on dim 1: two strided layouts on one dim cannot be described."""
    from torch.distributed.tensor import Shard

    # torch 2.13's _StridedShard is not a Shard subclass: test for it alone, then read its dim.
    if isinstance(param, DTensor) and any(
        is_strided_shard(p) and getattr(p, "dim", None) == 0 for p in param.placements
    ):
        return Shard(1)
    return None  # FSDP2's default, Shard(0)


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on or off, e.g. off on the non-final micro-steps of gradient accumulation."""
    from torch.distributed.fsdp import FSDPModule

    note_gradient_sync(module, enabled)
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled, recurse=True)
    elif is_ddp_replicated(module):
        cast(Any, module).set_requires_gradient_sync(enabled)  # a method replicate_ddp gave its class


class OptimizerStateSharding:
    """ZeRO stage 1: each data-parallel rank keeps optimizer states for, and updates, only the parameters it owns.

    Each rank owns a consecutive run of the parameters in the roots' order (DDP's bucket order, reversed), about
    1/dp of the elements: a gradient bucket then holds one contiguous segment per owner, reduced in place. The
    optimizer's ``step`` is wrapped: it first runs the closure
    (Lightning's forward, backward and gradient clipping, which see every gradient), then drops the gradients of
    parameters owned elsewhere, so torch optimizers neither create state for nor update them, steps, and finally
    every owner broadcasts its updated parameters in one flattened message. ``param_groups`` stay untouched, so LR
    schedulers, clipping and ``state_dict`` see the optimizer the user built.

    ``local`` parameters are stepped by every rank on its own shard (experts under expert parallelism: sharded
    over their own mesh, not replicated over data parallelism), never broadcast.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        dp_mesh: DeviceMesh,
        roots: Collection[nn.Module] = (),
        precision_plugin: Any = None,
        local: Collection[torch.Tensor] = (),
    ) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "zero_stage=1 cannot shard LBFGS: it re-evaluates the closure inside `step`. Use zero_stage=0."
            )
        self.optimizer = optimizer
        self._group = dp_mesh.get_group()
        self._rank = dp_mesh.get_local_rank()
        self._global_ranks = dist.get_process_group_ranks(self._group)
        local = set(local)
        params = [p for group in optimizer.param_groups for p in group["params"] if p not in local]
        order = {p: i for i, p in enumerate(p for root in roots for p in root.parameters())}
        params.sort(key=lambda p: order.get(p, len(order)))  # stable: the optimizer's order otherwise
        self.owned_by = _balance(params, dp_mesh.size())
        self._by_owner = [[p for p, o in self.owned_by.items() if o == owner] for owner in range(dp_mesh.size())]
        self._unwrapped_step = optimizer.step
        install_step(optimizer, self._step)
        # DDP roots reduce each gradient to its owner only; the clip then sums the owners' norms over the group.
        self._owner_reduces = [reduce for root in roots if (reduce := _owner_reduce_of(root)) is not None]
        self._precision_plugin = precision_plugin if self._owner_reduces else None
        for reduce in self._owner_reduces:
            reduce.owner.update({p: self._global_ranks[r] for p, r in self.owned_by.items()})
        if self._precision_plugin is not None:
            self._precision_plugin.grad_norm_group = self._group
            # Several optimizers (a GAN's two): each sharding adds its own parameters to what is counted elsewhere.
            self._counted_before = self._precision_plugin.grads_counted_elsewhere
            self._precision_plugin.grads_counted_elsewhere = self._counted_elsewhere

    def owns(self, param: torch.Tensor) -> bool:
        return self.owned_by[param] == self._rank

    def remove(self) -> None:
        self.optimizer.step = self._unwrapped_step  # type: ignore[method-assign]
        for reduce in self._owner_reduces:
            for param in self.owned_by:
                reduce.owner.pop(param, None)
        if self._precision_plugin is not None:  # the shardings are removed in the reverse order of their making
            self._precision_plugin.grads_counted_elsewhere = self._counted_before
            if self._counted_before is frozenset:
                self._precision_plugin.grad_norm_group = None

    def _counted_elsewhere(self) -> set[int]:
        """Parameters whose gradient was reduced to another rank (this optimizer's or an earlier sharded one's): that
        owner counts them in the global norm."""
        return {id(p) for p, owner in self.owned_by.items() if owner != self._rank} | set(self._counted_before())

    def _step(self, closure: Callable[[], object] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for owner, params in enumerate(self._by_owner):
            for param in params if owner != self._rank else ():
                param.grad = None
        self._unwrapped_step()
        self._broadcast_updates()
        return loss

    @torch.no_grad()
    def _broadcast_updates(self) -> None:
        for owner, (global_rank, params) in enumerate(zip(self._global_ranks, self._by_owner)):
            if not params:
                continue
            tensors = [_local(p) for p in params]
            flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
            dist.broadcast(flat, src=global_rank, group=self._group)
            if owner != self._rank:
                for tensor, value in zip(tensors, _unflatten(flat, tensors)):
                    tensor.copy_(value)


class _OwnerReduce:
    """DDP communication hook state: each parameter's gradient goes to its owner's global rank (``owner``).

    Parameters without an owner (none yet, or another optimizer's) are all-reduced, as DDP's default hook does.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.owner: dict[torch.Tensor, int] = {}


def _reduce_to_owners(state, bucket):  # type: ignore[no-untyped-def]  # untyped: DDP checks the hook's annotations
    """DDP communication hook: one reduce per owner of the bucket's gradients (all-reduce for unowned ones), on the
    bucket's own memory where an owner's gradients lie side by side; only the owner averages its part."""
    buffer = bucket.buffer()
    futures, mine = [], []
    me = dist.get_rank()
    for owner, spans in _owner_spans(bucket.parameters(), state.owner).items():
        views = [buffer[start:end] for start, end in spans]
        flat = views[0] if len(views) == 1 else torch.cat(views)
        if owner is None:
            work = dist.all_reduce(flat, group=state.group, async_op=True)
        else:
            work = dist.reduce(flat, dst=owner, group=state.group, async_op=True)
        futures.append(work.get_future())
        if owner in (None, me):
            mine.append((flat, views))

    def unpack(_: Any) -> torch.Tensor:
        for flat, views in mine:
            flat.div_(state.world)
            if len(views) > 1:
                for view, value in zip(views, _unflatten(flat, views)):
                    view.copy_(value)
        return buffer

    return torch.futures.collect_all(futures).then(unpack)


def _owner_spans(params: list[torch.Tensor], owner: dict[torch.Tensor, int]) -> dict[int | None, list[list[int]]]:
    """``{owner: [[start, end], ...]}``: each owner's runs of consecutive elements in a bucket of ``params``."""
    spans: dict[int | None, list[list[int]]] = {}
    offset = 0
    for param in params:
        runs = spans.setdefault(owner.get(param), [])
        if runs and runs[-1][1] == offset:
            runs[-1][1] += param.numel()
        else:
            runs.append([offset, offset + param.numel()])
        offset += param.numel()
    return spans


def _owner_reduce_of(root: nn.Module) -> _OwnerReduce | None:
    return getattr(root, "_lightning_mgpu_owner_reduce", None)


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` (the concatenation of ``like``, flattened) in the shapes of ``like``."""
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like)]


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param.data


def _balance(params: list[torch.Tensor], num_ranks: int) -> dict[torch.Tensor, int]:
    """Consecutive runs of ``params`` (in their order), one per rank, of about equal element counts: a tensor goes to
    the rank whose share holds its middle element, so a rank holds its share give or take the largest tensor."""
    total = max(1, sum(p.numel() for p in params))
    owner: dict[torch.Tensor, int] = {}
    done = 0
    for param in params:
        owner[param] = min(num_ranks - 1, (2 * done + param.numel()) * num_ranks // (2 * total))
        done += param.numel()
    return owner


def reduce_metrics_over(module: torch.nn.Module, group: ProcessGroup, patches: PatchLog | None = None) -> None:
    """Make torchmetrics objects sync over the data-parallel group, not the whole world (undone by ``patches``)."""
    from torchmetrics import Metric

    for submodule in module.modules():
        if isinstance(submodule, Metric):
            if patches is not None:
                patches.keep_attribute(submodule, "process_group")
            submodule.process_group = group
