"""The user's step run on one batch before training, where a parallelizer must see how the model is really called
(the automatic tensor-parallel plan reads the call of a block inside the model's forward), with nothing of the run
kept: no gradient, no random number drawn, ``self.log`` muted, and every attribute, child, parameter slot and
buffer value of the module's tree as it was before.

The parallelizer that asks for the run ends it where it has seen enough (by raising from a hook), so a step usually
runs only up to the first block. Under pretrained weights (parameters still on the meta device) the batch is moved
to the meta device too, and the step computes shapes only.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from lightning_mgpu._compat.tensors import module_structure, set_module_structure, tree_map


class LogRecord(Protocol):
    def record(self, name: str, value: object, kwargs: dict) -> None: ...


class ExampleStep:
    """``module.<method>(batch, 0)`` on the batch ``fetch()`` returns (fetched on the first run only)."""

    def __init__(self, module: nn.Module, method: str, fetch: Callable[[], object]) -> None:
        self.module = module
        self.method = method
        self._fetch = fetch
        self._batch: list[Any] = []  # fetched once

    def run(self) -> Any:
        """Run the step; whatever it raises is raised (after everything was put back)."""
        devices = [d for d in {p.device for p in self.module.parameters()} if d.type not in ("cpu", "meta")]
        with torch.random.fork_rng(devices=devices), torch.no_grad(), _kept(self.module):
            if not self._batch:
                self._batch.append(self._fetch())
            batch = self._batch[0]
            if any(p.is_meta for p in self.module.parameters()):
                batch = tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, batch)
            with muted_logging(self.module, None):
                return getattr(self.module, self.method)(batch, 0)


@contextmanager
def _kept(module: nn.Module) -> Iterator[None]:
    """Every module's attributes, children, parameter and buffer slots put back afterwards, and the values of its
    buffers, tensor attributes and list attributes (the demo Transformer keeps the mask its forward makes; BatchNorm
    updates its statistics in place, a torchmetrics metric its states)."""
    modules = list({id(m): m for m in module.modules()}.values())
    attributes = [dict(vars(m)) for m in modules]
    structures = [module_structure(m) for m in modules]
    tensors = {id(t): t for t in module.buffers()}
    tensors.update({id(v): v for saved in attributes for v in saved.values() if torch.is_tensor(v)})
    values = [(t, t.detach().clone()) for t in tensors.values()]
    lists = [(v, list(v)) for saved in attributes for v in saved.values() if isinstance(v, list)]
    try:
        yield
    finally:
        for sub, saved, structure in zip(modules, attributes, structures, strict=True):
            for name in set(vars(sub)) - set(saved):
                del vars(sub)[name]
            vars(sub).update(saved)
            set_module_structure(sub, *structure)
        with torch.no_grad():
            for tensor, value in values:
                tensor.copy_(value)
        for items, saved_items in lists:
            items[:] = saved_items


_ABSENT = object()


def restore_attribute(module: nn.Module, name: str, saved: Any) -> None:
    """Put back the instance attribute ``name`` as it was (``_ABSENT``: there was none)."""
    if saved is _ABSENT:
        object.__delattr__(module, name)
    else:
        object.__setattr__(module, name, saved)


def instance_attribute(module: nn.Module, name: str) -> Any:
    """The instance attribute ``name``, or ``_ABSENT`` (for :func:`restore_attribute`)."""
    return vars(module).get(name, _ABSENT)


@contextmanager
def muted_logging(module: nn.Module, record: LogRecord | None) -> Generator[None, None, None]:
    """Route ``self.log``/``self.log_dict`` into ``record`` (or nowhere) inside the block; put them back after."""

    def log(name: str, value: object, *args: object, **kwargs: object) -> None:
        if record is not None:
            record.record(name, value, kwargs)

    def log_dict(dictionary: Any, *args: object, **kwargs: object) -> None:
        from torchmetrics import MetricCollection

        if isinstance(dictionary, MetricCollection):  # as Lightning: its metrics, under their collection names
            dictionary = dict(dictionary.items(keep_base=False, copy_state=False))
        for name, value in dictionary.items():
            log(name, value, **kwargs)

    saved = {name: instance_attribute(module, name) for name in ("log", "log_dict")}
    object.__setattr__(module, "log", log)
    object.__setattr__(module, "log_dict", log_dict)
    try:
        yield
    finally:
        for name, value in saved.items():
            restore_attribute(module, name, value)
