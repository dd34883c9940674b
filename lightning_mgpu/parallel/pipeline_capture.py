"""Capture and replay of the user's step around its one network call (see ``pipeline_step``).

*Capture* runs the user's step until it calls the network (``self(x)`` or a module on the path to the blocks, such
as ``self.model(input_ids=x)``) and records the call's arguments. The rest of the step must not run, so the
forward pre-hook on those modules leaves the user's code by raising ``_NetworkCalled`` (the one way to leave
arbitrary user code; nothing else in the runtime uses an exception to steer). *Replay* runs the whole step again
with the network call returning a given output, counting the network calls so that a second one is refused.

While capturing or replaying, ``self.log``/``self.log_dict`` are routed into a ``StepLogs`` record (or nowhere);
every attribute set on the user's objects is set back before returning, and ``remove()`` takes the hooks off.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_mgpu.parallel.pipeline import NetworkCall
from lightning_mgpu.parallel.pipeline_publish import StepLogs


class _NetworkCalled(Exception):
    """Ends a capture at the network call, carrying the call (raised through the user's step)."""

    def __init__(self, call: NetworkCall) -> None:
        super().__init__()
        self.call = call


class _Phase(enum.Enum):
    IDLE = "idle"
    CAPTURE = "capture"
    REPLAY = "replay"


class StepCapture:
    """The network-call hooks on ``network_path`` (the LightningModule and the modules down to the blocks)."""

    def __init__(self, module: nn.Module, network_path: list[nn.Module]) -> None:
        self.module = module
        self._phase = _Phase.IDLE
        self._network_calls = 0
        self._hooks = [m.register_forward_pre_hook(self._on_network_call, with_kwargs=True) for m in network_path]

    def _on_network_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._phase is _Phase.CAPTURE:
            raise _NetworkCalled(NetworkCall(module, args, kwargs))
        if self._phase is _Phase.REPLAY:
            self._network_calls += 1
            if self._network_calls > 1:
                raise RuntimeError(
                    "With pipeline_parallel_size > 1 a step may call the network once (it runs split across"
                    f" ranks); {type(module).__name__} was called again. Compute everything from one call's output."
                )

    def capture(self, step: Callable[[], Any]) -> NetworkCall:
        """The network call ``step()`` makes; the step stops there and logs nothing."""
        return self.capture_all([step])[0]

    def capture_all(self, steps: list[Callable[[], Any]]) -> list[NetworkCall]:
        """The network call of each of ``steps`` (one per microbatch), with logging muted once for all."""
        self._phase = _Phase.CAPTURE
        try:
            with muted_logging(self.module, None):
                return [_network_call(step) for step in steps]
        finally:
            self._phase = _Phase.IDLE

    def replay(self, call: NetworkCall, output: Any, step: Callable[[], Any], logs: StepLogs) -> Any:
        """``step()``'s result with ``call``'s module returning ``output``; its logs go into ``logs``."""
        module = call.module
        saved = vars(module).get("forward", _ABSENT)
        # Plain instance attributes (what nn.Module.__setattr__ ends in for a function): once per microbatch.
        object.__setattr__(module, "forward", lambda *a, **k: output)
        self._phase, self._network_calls = _Phase.REPLAY, 0
        try:
            with muted_logging(self.module, logs):
                return step()
        finally:
            self._phase = _Phase.IDLE
            _restore(module, "forward", saved)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _network_call(step: Callable[[], Any]) -> NetworkCall:
    try:
        step()
    except _NetworkCalled as called:
        return called.call
    raise RuntimeError(
        "With pipeline_parallel_size > 1 the step must call the network (`self(x)` or the submodule holding the"
        " blocks, e.g. `self.model(...)`), but it returned without doing so."
    )


_ABSENT = object()


def _restore(module: nn.Module, name: str, saved: Any) -> None:
    """Put back the instance attribute ``name`` as it was (``_ABSENT``: there was none)."""
    if saved is _ABSENT:
        object.__delattr__(module, name)
    else:
        object.__setattr__(module, name, saved)


@contextmanager
def muted_logging(module: nn.Module, record: StepLogs | None) -> Generator[None, None, None]:
    """Route ``self.log``/``self.log_dict`` into ``record`` (or nowhere) inside the block; put them back after."""

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if record is not None:
            record.record(name, value, kwargs)

    def log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
        from torchmetrics import MetricCollection

        if isinstance(dictionary, MetricCollection):  # as Lightning: its metrics, under their collection names
            dictionary = dict(dictionary.items(keep_base=False, copy_state=False))
        for name, value in dictionary.items():
            log(name, value, **kwargs)

    attributes = vars(module)
    saved = {name: attributes.get(name, _ABSENT) for name in ("log", "log_dict")}
    object.__setattr__(module, "log", log)
    object.__setattr__(module, "log_dict", log_dict)
    try:
        yield
    finally:
        for name, value in saved.items():
            _restore(module, name, value)
