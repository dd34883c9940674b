"""DataLoader internals (checked on torch 2.13.0).

``with_sampler``: a shallow copy of a ``DataLoader`` with another (batch) sampler. ``DataLoader`` refuses to set
``sampler``/``batch_sampler`` after ``__init__``, and rebuilding one from its arguments loses what a user set on
it afterwards; the copy writes the attribute and resets the cached iterator (``_iterator``) in its ``__dict__``.
"""

from __future__ import annotations

import copy

from torch.utils.data import DataLoader

from lightning_mgpu._compat import changed


def with_sampler(loader: DataLoader, attribute: str, sampler: object) -> DataLoader:
    """A copy of ``loader`` whose ``attribute`` (``"sampler"`` or ``"batch_sampler"``) is ``sampler``."""
    if "_iterator" not in loader.__dict__:
        raise AttributeError(changed("DataLoader._iterator", "torch", "the cached iterator moved"))
    clone = copy.copy(loader)
    clone.__dict__[attribute] = sampler
    clone.__dict__["_iterator"] = None
    return clone
