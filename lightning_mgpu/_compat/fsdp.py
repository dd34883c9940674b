"""torch's composable data-parallel APIs not yet public (checked on torch 2.13.0).

- ``replicate_with_fsdp``: ``torch.distributed._composable.replicate_with_fsdp.replicate``, FSDP2's replicate
  (ZeRO 0/1 through FSDP2's machinery when a precision policy or offloading is asked). ``fully_shard`` is public;
  its replicate sibling is not yet.
- ``replicate_ddp`` / ``DDPModule``: ``torch.distributed._composable.replicate`` and its ``DDP`` marker class,
  DDP applied in place (no wrapper module, so FQNs and the LightningModule stay as they are). The public
  ``DistributedDataParallel`` wraps the module, which changes every parameter name.
- ``forget_composable_state``: ``torch.distributed._composable_state._module_state_mapping``, where torch records
  that ``fully_shard``/``replicate`` was applied to a module; there is no public way to un-apply them.
- ``is_torch_added_attribute``: the private attributes ``fully_shard``, ``replicate`` and ``distribute_module`` set
  on the modules they apply to (``__composable_api_state_key*``, ``_is_fsdp_managed_module``,
  ``_fsdp_use_orig_params``, ``_distribute_module_applied``); none of them has a public undo.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_mgpu._compat import internal


def replicate_with_fsdp(module: Any, **kwargs: Any) -> Any:
    return internal("torch.distributed._composable.replicate_with_fsdp", "replicate")(module, **kwargs)


def replicate_ddp(module: nn.Module, **kwargs: Any) -> Any:
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


# What torch's composable APIs leave on the modules they apply to, as attribute names (checked on torch 2.13.0).
_ADDED_PREFIX = "__composable_api_state_key"  # torch.distributed._composable.contract.generate_state_key
_ADDED_NAMES = frozenset({"_distribute_module_applied", "_is_fsdp_managed_module", "_fsdp_use_orig_params"})


def is_torch_added_attribute(name: str) -> bool:
    """Whether ``name`` is an attribute ``fully_shard``/``replicate``/``distribute_module`` set on a module."""
    return name.startswith(_ADDED_PREFIX) or name in _ADDED_NAMES
