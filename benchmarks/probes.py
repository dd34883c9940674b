"""What a rank reads around its steps: the step probe of a Trainer, memory and sharding, the collectives issued.

A script's numbers beside the step times come from here, read the same way for every configuration:
``make_step_probe`` (a Lightning callback) times every step with ``timing.LoopTimer``, reads memory and sharding
per rank right after backward (``memory_per_rank``, ``sharding``), counts the collectives of one extra, untimed step
(``profiled_collectives``) and runs any other context manager around an untimed step (``probes``, told the phase).
A plain loop uses the same pieces directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.run import quiet_fds
from benchmarks.timing import LoopTimer
from tests.helpers.probes import collectives_of, local_bytes


def memory_per_rank(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """Bytes of parameters (local shards), their ``.grad`` and the optimizers' state tensors held by this rank."""
    params = list({id(p): p for p in module.parameters()}.values())
    state = [t for opt in optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optim": sum(local_bytes(t) for t in state if t.dim() > 0),
    }


def sharding(module: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, placements, local shape) per parameter: to compare runs' sharding."""
    from torch.distributed.tensor import DTensor

    return [
        (name, str(tuple(p.placements)), tuple(p.to_local().shape))
        if isinstance(p, DTensor)
        else (name, "plain", tuple(p.shape))
        for name, p in module.named_parameters()
    ]


class profiled_collectives:
    """Context manager: the collectives this rank issued inside it (``.result``; see
    ``tests.helpers.probes.collectives_of``).

    Uses ``torch.profiler``, which also sees collectives issued from C++ (DDP's reducer), not only Python calls.
    ``ops``: also ``result["ops"]``, the count and self CPU ms of every op.
    """

    def __init__(self, world_size: int, verbose: bool = False, ops: bool = False) -> None:
        self.world_size = world_size
        self.verbose = verbose
        self.ops = ops
        self.result: dict[str, Any] | None = None

    def __enter__(self) -> profiled_collectives:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        with quiet_fds(not self.verbose):
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        with quiet_fds(not self.verbose):
            self._profiler.__exit__(*exc)
        self.result = collectives_of(self._profiler, self.world_size)
        if self.ops:  # {op: (count, self CPU ms)}
            averages = self._profiler.key_averages()
            self.result["ops"] = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in averages}


def make_step_probe(
    mem_step: int = 2,
    profile_step: int | None = None,
    verbose: bool = False,
    probes: dict[int, Callable[[Any], Any]] | None = None,
    ops: bool = False,
) -> Any:
    """A Lightning callback timing every step like ``LoopTimer`` (phases at ``on_before_backward`` and
    ``on_after_backward``), reading memory and sharding at optimizer step ``mem_step`` and profiling the
    collectives of step ``profile_step`` (``ops``: also the op counts), left out of the timings.

    ``probes``: ``{step: factory(trainer)}`` of more context managers, each run around its step (untimed; told the
    phase like ``LoopTimer.step(probe=...)``); their ``.result`` land in ``result()["probes"][step]``.
    """
    import lightning as L

    factories = dict(probes or {})
    if profile_step is not None:
        factories[profile_step] = lambda trainer: profiled_collectives(trainer.world_size, verbose, ops)

    class StepProbe(L.Callback):
        def __init__(self) -> None:
            self.timer = LoopTimer()
            self.memory: dict[str, int] | None = None
            self.sharding: list[tuple[str, str, tuple[int, ...]]] | None = None
            self.probed: dict[int, Any] = {}
            self._step: Any = None
            self._probe: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            factory = factories.get(trainer.global_step)
            self._probe = (trainer.global_step, factory(trainer)) if factory else None
            self._step = self.timer.step(probe=self._probe[1] if self._probe else None)
            self._step.__enter__()

        def on_before_backward(self, *args: Any) -> None:
            self.timer.mark("backward")

        def on_after_backward(self, *args: Any) -> None:
            self.timer.mark("optimizer")

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == mem_step and self.memory is None:
                self.memory = memory_per_rank(pl_module, trainer.optimizers)
                self.sharding = sharding(pl_module)

        def on_train_batch_end(self, *args: Any) -> None:
            self._step.__exit__(None, None, None)
            if self._probe is not None:
                self.probed[self._probe[0]] = self._probe[1].result

        def result(self) -> dict[str, Any]:
            comm = self.probed.get(profile_step) if profile_step is not None else None
            return {
                **self.timer.result(),
                "memory": self.memory,
                "sharding": self.sharding,
                "comm": comm,
                "probes": self.probed,
            }

    return StepProbe()
