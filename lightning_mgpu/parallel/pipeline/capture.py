"""Capture and replay of the user's step around its one network call (see ``pipeline_step``).

*Capture* runs the user's step until it calls the network (``self(x)`` or a module on the path to the blocks, such
as ``self.model(input_ids=x)``) and records the call's arguments. The rest of the step must not run, so the
``forward`` of those modules leaves the user's code by raising ``_NetworkCalled`` (the one way to leave arbitrary
user code; nothing else in the runtime uses an exception to steer). *Replay* runs the whole step again with the
network call returning a given output, and refuses a second network call.

Both work by setting ``forward`` as an instance attribute of the path's modules for the step's duration, as the replay's
output always was: no forward hooks stay on the user's modules, so the stages' own forwards (many per step, in between)
take ``nn.Module.__call__``'s fast path. The path modules' own forward pre-hooks run before the interception, so the
captured arguments are the ones they passed on, and the stage's run of the call passes those through them again (a hook
that rewrites its arguments must accept its own output). While capturing or replaying, ``self.log``/``self.log_dict``
are routed into a ``StepLogs`` record (or nowhere); every attribute set on the user's objects is set back before
returning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from torch import nn

from lightning_mgpu.parallel.example import instance_attribute, muted_logging, restore_attribute
from lightning_mgpu.parallel.pipeline.publish import StepLogs
from lightning_mgpu.parallel.pipeline.split import NetworkCall


class _NetworkCalled(Exception):
    """Ends a capture at the network call, carrying the call (raised through the user's step)."""

    def __init__(self, call: NetworkCall) -> None:
        super().__init__()
        self.call = call


class StepCapture:
    """Capture and replay of the network call on ``network_path`` (the LightningModule and the modules down to the
    blocks)."""

    def __init__(self, module: nn.Module, network_path: list[nn.Module]) -> None:
        self.module = module
        self.network_path = network_path

    def capture_all(self, steps: list[Callable[[], object]]) -> list[NetworkCall]:
        """The network call of each of ``steps`` (one per microbatch), with logging muted once for all."""
        with muted_logging(self.module, None), _forwards(self.network_path, _capturing):
            return [_network_call(step) for step in steps]

    def replay(self, call: NetworkCall, output: object, step: Callable[[], object], logs: StepLogs) -> object:
        """``step()``'s result with ``call``'s module returning ``output``; its logs go into ``logs``."""
        calls = 0

        def network(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError(_second_call(call.module))
            return output

        def forward_of(module: nn.Module) -> Callable[..., object]:
            return network if module is call.module else _refusing(module)

        with muted_logging(self.module, logs), _forwards(self.network_path, forward_of):
            return step()


@contextmanager
def _forwards(modules: list[nn.Module], forward_of: Callable[[nn.Module], Callable[..., object]]) -> Iterator[None]:
    """Each of ``modules`` runs ``forward_of(module)`` in place of its ``forward`` inside the block."""
    saved = [(module, instance_attribute(module, "forward")) for module in modules]
    for module in modules:
        # Plain instance attributes (what nn.Module.__setattr__ ends in for a function).
        object.__setattr__(module, "forward", forward_of(module))
    try:
        yield
    finally:
        for module, forward in saved:
            restore_attribute(module, "forward", forward)


def _capturing(module: nn.Module) -> Callable[..., object]:
    def network(*args: object, **kwargs: object) -> NoReturn:
        raise _NetworkCalled(NetworkCall(module, args, kwargs))

    return network


def _refusing(module: nn.Module) -> Callable[..., object]:
    def network(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(_second_call(module))

    return network


def _second_call(module: nn.Module) -> str:
    return (
        "With pipeline_parallel_size > 1 a step may call the network once (it runs split across ranks);"
        f" {type(module).__name__} was called again. Compute everything from one call's output."
    )


def _network_call(step: Callable[[], object]) -> NetworkCall:
    try:
        step()
    except _NetworkCalled as called:
        return called.call
    raise RuntimeError(
        "With pipeline_parallel_size > 1 the step must call the network (`self(x)` or the submodule holding the"
        " blocks, e.g. `self.model(...)`), but it returned without doing so."
    )
