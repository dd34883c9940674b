"""Several fits in one job: the runs of one world size train one after the other in the same forked ranks.

A job's fixed cost (forking the ranks, the process group, the first touches of lazily built state) is paid once for
all of them. Each run seeds itself as ``fit`` does (``seed_everything`` first), so a run computes what it computes
alone; a run that raises is reported as its traceback, and only the tests reading that run fail.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import lightning as L

from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import _REFERENCES, RunResult, _fit_worker, _reference_key

STEPS = 10
SEED = 1234


class Run:
    """One fit's arguments, as ``equivalence.fit`` takes them."""

    def __init__(
        self,
        module_factory: Callable[[], L.LightningModule],
        datamodule_factory: Callable[[], L.LightningDataModule],
        strategy_kwargs: dict[str, Any] | None = None,
        max_steps: int = STEPS,
        trainer_kwargs: dict[str, Any] | None = None,
        callbacks_factory: Callable[[], list[L.Callback]] | None = None,
        after_fit: Callable[[L.Trainer], Any] | None = None,
        before_fit: Callable[[L.Trainer, L.LightningModule, L.LightningDataModule], Any] | None = None,
    ) -> None:
        self.module_factory = module_factory
        self.datamodule_factory = datamodule_factory
        self.strategy_kwargs = strategy_kwargs
        self.max_steps = max_steps
        self.trainer_kwargs = trainer_kwargs or {}
        self.callbacks_factory = callbacks_factory
        self.after_fit = after_fit  # runs on every rank once `fit` returned (e.g. a collective export)
        self.before_fit = before_fit  # e.g. `trainer.validate(module, datamodule)` before the fit


def _fits_worker(runs: dict[str, Run], devices: int) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    for name, run in runs.items():
        try:
            outputs[name] = _fit_worker(
                run.module_factory,
                run.datamodule_factory,
                run.strategy_kwargs,
                devices,
                run.max_steps,
                SEED,
                run.trainer_kwargs,
                run.callbacks_factory,
                after_fit=run.after_fit,
                before_fit=run.before_fit,
            )
        except Exception:
            outputs[name] = traceback.format_exc()
    return outputs


def fit_each(
    runs: dict[str, Run], devices: int, timeout: float = 600.0
) -> dict[str, tuple[RunResult, list[dict[str, Any]]] | str]:
    """Fit every run on ``devices`` forked ranks in one job: ``{name: (rank 0's result, every rank's extras)}``, or
    ``{name: traceback}`` for a run that raised."""
    if not runs:  # a tier with no run of this world size
        return {}
    per_rank = run_distributed(_fits_worker, devices, runs, devices, timeout=timeout)
    results: dict[str, Any] = {}
    for name in runs:
        outputs = [rank[name] for rank in per_rank]
        failed = [f"rank {rank}: {o}" for rank, o in enumerate(outputs) if isinstance(o, str)]
        if failed:  # every failing rank's traceback: the first to fail is not always the first listed
            results[name] = "\n".join(failed)
            continue
        rank0 = next(o for o in outputs if o["rank"] == 0)
        results[name] = RunResult(rank0["losses"], rank0["state_dict"], rank0["extra"]), [o["extra"] for o in outputs]
    return results


def references(runs: dict[str, Run], timeout: float = 600.0) -> dict[str, RunResult | str]:
    """The one-process reference of every run (no strategy, no callbacks), those not yet computed this session in
    one job; shared with ``equivalence.fit``'s memo, so a reference another test computed is not run again."""
    keys = {
        name: _reference_key(run.module_factory, run.datamodule_factory, run.max_steps, SEED, run.trainer_kwargs)
        for name, run in runs.items()
    }
    plain = [
        r.strategy_kwargs is None and not r.callbacks_factory and not r.before_fit and not r.after_fit
        for r in runs.values()
    ]
    assert all(plain)
    missing: dict[str, Run] = {}  # one run per distinct key: two names computing the same thing share it
    for name, run in runs.items():
        if keys[name] is None or (keys[name] not in _REFERENCES and keys[name] not in [keys[m] for m in missing]):
            missing[name] = run
    computed = fit_each(missing, 1, timeout=timeout) if missing else {}
    results: dict[str, Any] = {}
    for name, outcome in computed.items():
        if isinstance(outcome, str):
            results[name] = outcome
        elif keys[name] is not None:
            _REFERENCES[keys[name]] = copy.deepcopy(outcome)
    for name in runs:
        if name in results:
            continue
        if name in computed and keys[name] is None:
            results[name] = computed[name][0]
        elif keys[name] in _REFERENCES:
            results[name] = copy.deepcopy(_REFERENCES[keys[name]])[0]
        else:  # shares the key of a run that failed
            results[name] = next(results[m] for m in missing if keys[m] == keys[name])
    return results


def result(outcome: Any) -> Any:
    """The run's result, or the test fails with the run's traceback."""
    if isinstance(outcome, str):
        raise AssertionError(f"the run failed:\n{outcome}")
    return outcome
