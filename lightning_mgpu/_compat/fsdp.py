"""torch's composable data-parallel APIs not yet public (checked on torch 2.13.0).

- ``replicate_with_fsdp``: ``torch.distributed._composable.replicate_with_fsdp.replicate``, FSDP2's replicate
  (ZeRO 0/1 through FSDP2's machinery when a precision policy or offloading is asked). ``fully_shard`` is public;
  its replicate sibling is not yet.
- ``replicate_ddp`` / ``DDPModule``: ``torch.distributed._composable.replicate`` and its ``DDP`` marker class,
  DDP applied in place (no wrapper module, so FQNs and the LightningModule stay as they are). The public
  ``DistributedDataParallel`` wraps the module, which changes every parameter name.
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
