"""The one place that touches torch, Lightning and torchmetrics internals.

Everything else in the package uses public APIs, or the names these shims export (``tests/_compat`` checks both:
a contract test per shim, and a scan of the package for private uses outside this folder). Each shim says which
public API it stands in for (or why there is none) and the versions it was checked on (``CHECKED``). A missing
internal fails at import with :class:`InternalChanged`, naming it and the installed version, never silently.

- ``amp.py``: GradScaler internals (lazy scale init, the settings a job-wide scaler copies, the unscale kernel).
- ``dcp.py``: torch.distributed.checkpoint helpers (FQNs through wrappers, loading without a process group).
- ``dtensor.py``: DTensor's strided shard and parallel-style hooks, DeviceMesh unflatten.
- ``fsdp.py``: the composable ``replicate`` APIs (DDP and FSDP2-based), un-applying composable APIs.
- ``c10d.py``: functional collectives and the pipelining send/receive that the monitor times.
- ``tensors.py``: pytree, dispatch modes, fake tensors, version counters, module-slot swaps and restores, hooks.
- ``lightning.py``: Lightning's launchers, distributed helpers, precision utilities and trainer internals.
- ``pipelining.py``: torch.distributed.pipelining internals of the pipeline runtime (its own contract test).
- ``deepspeed.py``: DeepSpeed's ZeRO-1/2 fragment mappings and optimizer-state linking (the DeepSpeed backend).
- ``versions.py``: the import-time guard refusing framework releases the shims were not checked on.
"""

from __future__ import annotations

import importlib
from typing import Any

# Versions every shim was checked on (the contract test runs against the installed ones).
CHECKED = {"torch": "2.13.0", "lightning": "2.6.6", "torchmetrics": "1.9.0"}


class InternalChanged(ImportError):
    """A framework internal a shim relies on is gone or changed: the shim needs updating for this version."""


def installed_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def internal(module: str, name: str) -> Any:
    """``module.name``, a private symbol of torch or Lightning; :class:`InternalChanged` if it is gone."""
    package = module.split(".")[0]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise InternalChanged(changed(f"{module}.{name}", package, str(error))) from error


def changed(what: str, package: str, detail: str = "") -> str:
    """The message for an internal that no longer behaves as a shim expects."""
    note = f" ({detail})" if detail else ""
    return (
        f"lightning_mgpu relies on {what}, an internal of {package} checked on {package} {CHECKED.get(package, '?')};"
        f" the installed {package} {installed_version(package)} differs{note}. Update lightning_mgpu/_compat or"
        f" install {package}=={CHECKED.get(package, '?')}."
    )


# The guard runs when the first shim is imported (every path into torch's or Lightning's internals passes here):
# an untested framework release is refused by name before any shim relies on it.
from lightning_mgpu._compat import versions as versions  # noqa: E402
