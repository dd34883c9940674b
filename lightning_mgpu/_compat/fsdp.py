"""torch's composable data-parallel APIs not yet public (checked on torch 2.13.0 and lightning 2.6.6).

- ``replicate_with_fsdp``: ``torch.distributed._composable.replicate_with_fsdp.replicate``, FSDP2's replicate
  (ZeRO 0/1 through FSDP2's machinery when a precision policy or offloading is asked). ``fully_shard`` is public;
  its replicate sibling is not yet.
- ``replicate_ddp`` / ``DDPModule``: ``torch.distributed._composable.replicate`` and its ``DDP`` marker class,
  DDP applied in place (no wrapper module, so FQNs and the LightningModule stay as they are). The public
  ``DistributedDataParallel`` wraps the module, which changes every parameter name.
- ``ddp_of`` / ``ddp_syncs_gradients`` / ``rebuild_ddp`` / ``reducer_finalized`` / ``ranks_that_used``: the
  ``DistributedDataParallel`` object ``replicate`` keeps in its composable state (``_ReplicateState._ddp``,
  ``_param_list``, ``_no_sync``) and its reducer's ``_check_reducer_finalized``, ``_get_local_used_map`` and
  ``_remove_autograd_hooks``: a reducer's ``find_unused_parameters`` is fixed when it is built, and there is no
  public way to read which parameters a step used.
- ``prepare_ddp_backward`` / ``skip_ddp_post_forward_reduction``: Lightning's
  ``lightning.pytorch.overrides.distributed.prepare_for_backward`` (what its ``DDPStrategy.pre_backward`` calls under
  manual optimization), which runs the reducer's private ``_rebuild_buckets`` and ``prepare_for_backward``, and the
  ``require_backward_grad_sync`` flag Lightning's ``_DDPForwardRedirection`` clears when a manual step returns: DDP
  readies its reducer when the forward returns, and there is no public way to ready it for a backward that runs
  inside the forward (``manual_backward`` inside ``training_step``), nor to keep it from expecting one more after.
- ``forget_composable_state``: ``torch.distributed._composable_state._module_state_mapping``, where torch records
  that ``fully_shard``/``replicate`` was applied to a module; there is no public way to un-apply them.
- ``init_fsdp_root``: ``FSDPState._lazy_init`` of ``fully_shard``'s (and FSDP2 ``replicate``'s) state, which makes the
  first module whose forward runs FSDP's root; there is no public way to name the root before a forward, and a
  submodule called first (a rollout in a data loader, a callback sampling before training) became a root itself.
- ``reshard_fsdp``: ``FSDPParamGroup._training_state``: ``FSDPModule.reshard()`` keeps a group that is still in its
  forward gathered (unless it reshards after forward), and a forward left by an exception (a pipeline stage ends
  at its last block by raising out of that block's forward) never returns the group to idle; nothing public does.
- ``follow_into_backward``: ``FSDPState._pre_backward`` (through ``FSDPModule._get_fsdp_state``), the tensor hook
  FSDP2's post-forward registers on the gradient-needing tensors it finds in a forward's output (``tuple``,
  ``list``, ``dict``, namedtuple and dataclass containers only: ``_common_utils.collect_grad_tensors``); nothing
  public registers it on tensors a forward returns inside another object (a ``torch.distributions`` object).
- ``is_torch_added_attribute``: the private attributes ``fully_shard``, ``replicate`` and ``distribute_module`` set
  on the modules they apply to (``__composable_api_state_key*``, ``_is_fsdp_managed_module``,
  ``_fsdp_use_orig_params``, ``_distribute_module_applied``); none of them has a public undo.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_mgpu._compat import changed, internal

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel


def replicate_with_fsdp(module: nn.Module, **kwargs: object) -> nn.Module:
    return internal("torch.distributed._composable.replicate_with_fsdp", "replicate")(module, **kwargs)


def replicate_ddp(module: nn.Module, **kwargs: object) -> nn.Module:
    return internal("torch.distributed._composable.replicate", "replicate")(module, **kwargs)


def is_ddp_replicated(module: nn.Module) -> bool:
    """Whether ``replicate_ddp`` was applied to ``module``."""
    return isinstance(module, internal("torch.distributed._composable.replicate", "DDP"))


def forget_composable_state(module: nn.Module) -> None:
    """Drop torch's record that ``fully_shard``/``replicate`` was applied to ``module`` (un-applying them).

    Torch keeps it in a private module-keyed map (``torch.distributed._composable_state._module_state_mapping``)
    and refuses to apply the API again while an entry is there; there is no public way to un-apply one. Used when
    the user's module is put back after a run (``lightning_mgpu.patches``), so that a second ``fit`` can apply it.
    """
    internal("torch.distributed._composable_state", "_module_state_mapping").pop(module, None)


def init_fsdp_root(module: nn.Module) -> None:
    """Make ``module`` (``fully_shard``ed, or FSDP2-``replicate``d) FSDP's root, as its first forward would: its
    units learn they are not roots, so they may run their own forwards first (torch refuses the root's forward once
    a unit ran one: "FSDP state has already been lazily initialized"). Needs the parameters materialized."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return
    state = module._get_fsdp_state()
    if not hasattr(state, "_lazy_init"):
        raise AttributeError(changed("FSDPState._lazy_init", "torch", "the method is gone"))
    state._lazy_init()


def reshard_fsdp(module: nn.Module) -> None:
    """``module.reshard()`` (not recursive), also when its last forward did not return: its groups are marked done
    with that forward first, as FSDP2's post-forward would have marked them, so that the sharded parameters, the
    ones its optimizer steps, are registered again."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return
    training_state = internal("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState")
    for group in module._get_fsdp_state()._fsdp_param_groups:
        if not hasattr(group, "_training_state"):
            raise AttributeError(changed("FSDPParamGroup._training_state", "torch", "the attribute is gone"))
        if group._training_state == training_state.FORWARD:
            group._training_state = training_state.IDLE
    module.reshard()


def follow_into_backward(module: nn.Module, tensors: Iterable[torch.Tensor]) -> None:
    """FSDP2's pre-backward of ``module`` (``fully_shard``ed) hooked on ``tensors``, as its post-forward hooks the
    tensors it finds in the output: the first gradient reaching one gathers the parameters again and readies the
    reduction of their gradients at the backward's end (the hook does nothing more once the backward started)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        raise TypeError(f"follow_into_backward needs a fully_shard-ed module, not {type(module).__name__}")
    state = module._get_fsdp_state()
    if not hasattr(state, "_pre_backward"):
        raise AttributeError(changed("FSDPState._pre_backward", "torch", "the method is gone"))
    for tensor in tensors:
        tensor.register_hook(state._pre_backward)


# What torch's composable APIs leave on the modules they apply to, as attribute names (checked on torch 2.13.0).
_ADDED_PREFIX = "__composable_api_state_key"  # torch.distributed._composable.contract.generate_state_key
_ADDED_NAMES = frozenset({"_distribute_module_applied", "_is_fsdp_managed_module", "_fsdp_use_orig_params"})


def is_torch_added_attribute(name: str) -> bool:
    """Whether ``name`` is an attribute ``fully_shard``/``replicate``/``distribute_module`` set on a module."""
    return name.startswith(_ADDED_PREFIX) or name in _ADDED_NAMES


def ddp_of(module: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` object behind ``replicate_ddp(module)``; None until its first forward builds
    it (torch keeps it in the composable state, ``_ReplicateState._ddp``)."""
    state = internal("torch.distributed._composable.replicate", "replicate").state(module)
    return None if state is None or state._init_args else getattr(state, "_ddp", None)


def ddp_syncs_gradients(module: nn.Module) -> bool:
    """Whether the next forward of ``replicate_ddp(module)`` synchronizes gradients (its ``no_sync`` flag)."""
    return not internal("torch.distributed._composable.replicate", "replicate").state(module)._no_sync


def rebuild_ddp(module: nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """Replace the ``DistributedDataParallel`` object behind ``replicate_ddp(module)`` by one built with ``kwargs``.

    A reducer's settings (``find_unused_parameters``) are fixed when it is built. The old reducer's gradient hooks
    are removed; the new one moves existing gradients into its own buckets. Parameters are not broadcast again
    (``init_sync=False``): the replicas already agree.
    """
    from torch.nn.parallel import DistributedDataParallel

    state = internal("torch.distributed._composable.replicate", "replicate").state(module)
    state._ddp._remove_autograd_hooks()
    state._ddp = DistributedDataParallel(state._param_list, init_sync=False, **kwargs)
    return state._ddp


def prepare_ddp_backward(module: nn.Module, output: object) -> None:
    """Ready the reducer of ``replicate_ddp(module)`` for a backward of ``output`` that runs inside the module's own
    forward, as Lightning's ``DDPStrategy`` does under manual optimization; the reducer then reduces every gradient
    of that backward (with ``find_unused_parameters``: marking the parameters ``output`` does not reach as unused).
    A no-op before the first forward built the reducer."""
    ddp = ddp_of(module)
    if ddp is not None:
        internal("lightning.pytorch.overrides.distributed", "prepare_for_backward")(ddp, output)


def skip_ddp_post_forward_reduction(module: nn.Module) -> None:
    """Keep the end of ``replicate_ddp(module)``'s current forward from readying the reducer for a backward of its
    output: the step ran its backwards inside (a reducer left expecting one fails the next forward). Lasts until the
    next forward, which sets the flag from ``set_requires_gradient_sync`` again."""
    ddp = ddp_of(module)
    if ddp is not None:
        ddp.require_backward_grad_sync = False


def reducer_finalized(ddp: DistributedDataParallel) -> bool:
    """Whether the last backward that synchronized gradients reduced every bucket (``Reducer._check_reducer_finalized``
    raises otherwise: a parameter got no gradient, or the step's loss was not backpropagated)."""
    try:
        ddp._check_reducer_finalized()
    except RuntimeError:
        return False
    return True


def ranks_that_used(ddp: DistributedDataParallel) -> torch.Tensor:
    """Per parameter of the reducer, how many ranks gave it a gradient in the last synchronized step (the map DDP
    all-reduces when it looks for unused parameters: ``Reducer._get_local_used_map``)."""
    return ddp.reducer._get_local_used_map()
