"""After ``fit`` the user's module is a plain torch module again, with the trained weights, on every rank.

Each layout fits one module twice (two Trainers), then, with no process group left, checks that the module has
its classes, hooks, attributes, children and parameter objects back (as plain Lightning leaves them), that its
parameters are plain tensors holding what one process trains in the same steps, and that it runs forward and
backward in plain torch. The second fit must train like the reference's second fit.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import LossRecorder
from tests.helpers.modules import LlamaModule, RandomTokenDataModule

GLOBAL_BATCH = 8
STEPS = 2  # per fit
TOLERANCE = 1e-5
_HOOKS = tuple(name for name in vars(nn.Module()) if "hook" in name)


def _structure(module: nn.Module) -> dict[str, Any]:
    """What a patch could leave behind: each module's class, attributes, hooks, children and parameter objects."""
    return {
        name: (
            type(sub),
            frozenset(vars(sub)),
            {attr: repr(getattr(sub, attr)) for attr in _HOOKS},
            {child: id(m) for child, m in sub._modules.items()},
            {param: id(p) for param, p in sub._parameters.items()},
        )
        for name, sub in module.named_modules()
    }


class _RunSeen(L.Callback):
    """What ``trainer.strategy.run`` holds during training: the one object the strategy's hooks drive."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        run = getattr(trainer.strategy, "run", None)
        if run is not None:
            self.seen = {
                "run": type(run).__name__,
                "pipeline": run.pipeline is not None,
                "steps_what_lightning_calls": run.runner is trainer.strategy.model,
                "roots": len(run.roots),
            }


def _fit_twice(strategy_kwargs: dict[str, Any] | None, batch_size: int) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_mgpu import HybridStrategy

    world_size = int(os.environ["WORLD_SIZE"])  # Lightning's teardown removes it
    L.seed_everything(1234, verbose=False)
    module = LlamaModule()
    before = _structure(module)
    losses, runs = [], []
    for _ in range(2):
        recorder, run_seen = LossRecorder(), _RunSeen()
        timeout = timedelta(seconds=120)
        strategy = (
            DDPStrategy(timeout=timeout)
            if strategy_kwargs is None
            else HybridStrategy(timeout=timeout, **strategy_kwargs)
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=STEPS,
            callbacks=[recorder, run_seen],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, RandomTokenDataModule(batch_size=batch_size))
        losses.append(recorder.losses)
        runs.append({**run_seen.seen, "after_fit": getattr(trainer.strategy, "run", None)})
    rank = dist.get_rank()
    dist.destroy_process_group()
    changed = _changes(before, _structure(module))
    plain = _use_plainly(module, trainer.optimizers[0])
    return {"rank": rank, "losses": losses, "runs": runs, "changed": changed, **plain}


def _changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per module, what differs from before the fits (attribute names compared as added/removed sets)."""
    changes: dict[str, Any] = {}
    if set(before) != set(after):
        changes["<modules>"] = (sorted(set(before) - set(after)), sorted(set(after) - set(before)))
    for name in set(before) & set(after):
        (cls0, keys0, *rest0), (cls1, keys1, *rest1) = before[name], after[name]
        diff = {}
        if cls0 is not cls1:
            diff["class"] = (cls0.__name__, cls1.__name__)
        if keys0 != keys1:
            diff["attributes"] = (sorted(keys0 - keys1), sorted(keys1 - keys0))
        for label, old, new in zip(("hooks", "children", "parameters"), rest0, rest1):
            if old != new:
                diff[label] = (old, new)
        if diff:
            changes[name] = diff
    return changes


def _use_plainly(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Plain-torch use with no process group: the parameters' types, a forward, a backward and an optimizer step."""
    kinds = {name: (type(p).__name__, type(p.data).__name__, p.device.type) for name, p in module.named_parameters()}
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    module.zero_grad(set_to_none=True)
    logits = module(x)
    logits.float().pow(2).mean().backward()
    grads_plain = all(p.grad is not None and not isinstance(p.grad, DTensor) for p in module.parameters())
    state_dict = {k: v.detach().clone() for k, v in module.state_dict().items()}
    # The last fit's optimizer steps the module's own parameters (under pipelining: this rank's stage's).
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    optimizer.step()
    return {
        "optimizer_on_module": bool(stepped) and stepped <= {id(p) for p in module.parameters()},
        "optimizer_states_plain": bool(states) and not any(isinstance(v, DTensor) for v in states),
        "kinds": kinds,
        "grads_plain": grads_plain,
        "logits": logits.detach(),
        "state_dict": state_dict,
    }


_reference: dict[str, Any] = {}


def _reference_run() -> dict[str, Any]:
    if not _reference:
        _reference.update(run_distributed(_fit_twice, 1, None, GLOBAL_BATCH)[0])
    return _reference


LAYOUTS = {
    "dp2-zero0": {"zero_stage": 0},
    "dp2-zero1": {"zero_stage": 1},
    "dp2-zero2": {"zero_stage": 2},
    "dp2-zero3": {"zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fit_twice_then_plain_torch(layout: str) -> None:
    reference = _reference_run()
    kwargs = LAYOUTS[layout]
    batch = GLOBAL_BATCH // 2 if layout.startswith("dp") else GLOBAL_BATCH
    results = run_distributed(_fit_twice, 2, kwargs, batch)
    for fit in range(2):
        torch.testing.assert_close(
            torch.tensor(results[0]["losses"][fit], dtype=torch.float64),
            torch.tensor(reference["losses"][fit], dtype=torch.float64),
            rtol=TOLERANCE,
            atol=0.0,
            msg=lambda m: f"fit {fit + 1}'s losses: {m}",
        )
    pipelined = "pipeline_parallel_size" in kwargs
    for result in results:
        rank = result["rank"]
        # Each fit ran through one ParallelRun (this rank's stage under pipelining), handed back at teardown.
        for run in result["runs"]:
            expected = {"run": "ParallelRun", "pipeline": pipelined, "steps_what_lightning_calls": True, "roots": 1}
            assert run == {**expected, "after_fit": None}, (rank, run)
        # Nothing left at all (plain Lightning's DDP leaves an instance `forward` on the LightningModule; we don't).
        assert result["changed"] == {}, (rank, result["changed"])
        assert set(result["kinds"].values()) == {("Parameter", "Tensor", "cpu")}, (rank, result["kinds"])
        assert result["grads_plain"], rank
        assert result["optimizer_on_module"] and result["optimizer_states_plain"], rank
        assert set(result["state_dict"]) == set(reference["state_dict"])
        for key, expected in reference["state_dict"].items():
            torch.testing.assert_close(
                result["state_dict"][key],
                expected,
                rtol=TOLERANCE,
                atol=TOLERANCE,
                msg=lambda m: f"rank {rank} {key}: {m}",
            )
        torch.testing.assert_close(result["logits"], reference["logits"], rtol=TOLERANCE, atol=TOLERANCE)


class _FailsAtStep2(LlamaModule):
    """The user's training_step raises at the second step, on every rank."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 1:
            raise ValueError("the user's step 2 failed")
        return super().training_step(batch, batch_idx)


def _fit_and_fail(strategy_kwargs: dict[str, Any], batch_size: int) -> dict[str, Any]:
    from lightning_mgpu import HybridStrategy

    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    L.seed_everything(1234, verbose=False)
    module = _FailsAtStep2()
    before = _structure(module)
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=HybridStrategy(timeout=timedelta(seconds=120), **strategy_kwargs),
        max_steps=STEPS + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(module, RandomTokenDataModule(batch_size=batch_size))
        error = "fit did not fail"
    except ValueError as failure:
        error = str(failure)
    if dist.is_initialized():
        dist.destroy_process_group()
    trained = any(not torch.equal(initial[k], v) for k, v in module.state_dict().items())
    return {
        "rank": rank,
        "error": error,
        "changed": _changes(before, _structure(module)),
        "trained": trained,
        **_use_plainly(module, trainer.optimizers[0]),
    }


@pytest.mark.parametrize("layout", ["tp2", "dp2-zero3"])
def test_a_failed_fit_gives_the_module_back_plain(layout: str) -> None:
    """training_step raises at step 2 on every rank: the module still comes back plain with the values of the step
    that ran (every rank failed in the same run, so none is left in a collective). Under ZeRO-3 the root's FSDP
    group is left unsharded by the forward the step began: the optimizer must still be pointed at the module."""
    batch = GLOBAL_BATCH // 2 if layout.startswith("dp") else GLOBAL_BATCH
    results = run_distributed(_fit_and_fail, 2, LAYOUTS[layout], batch)
    for result in results:
        rank = result["rank"]
        assert result["error"] == "the user's step 2 failed", (rank, result["error"])
        assert result["changed"] == {}, (rank, result["changed"])
        assert set(result["kinds"].values()) == {("Parameter", "Tensor", "cpu")}, (rank, result["kinds"])
        assert result["grads_plain"] and result["trained"], rank
        assert result["optimizer_on_module"] and result["optimizer_states_plain"], rank
    # Full (gathered) weights on both ranks: the same values.
    for key, value in results[0]["state_dict"].items():
        torch.testing.assert_close(results[1]["state_dict"][key], value, rtol=0.0, atol=0.0)
