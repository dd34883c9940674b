"""Lightning's own examples under every layout, against Lightning's own ``DDPStrategy`` on the same processes.

The modules: ``BoringModel``, ``DemoModel``, ``ManualOptimBoringModel`` and ``LightningTransformer`` imported from
``lightning.pytorch.demos`` as they ship (the first three with their own data or ``BoringDataModule``, the
Transformer with ``WikiText2``-shaped token blocks), and the repository's ``examples/pytorch`` modules written out in
``tests/helpers/lightning_examples.py`` (autoencoder, backbone classifier, DQN, PPO, fine-tuning with
``MilestonesFinetuning``) and ``tests/test_manual_optimization.py`` (GAN). Each runs what its example's main runs
(``fit``; the basics examples then ``test`` and ``predict`` with ``ckpt_path="best"``), short, on synthetic data.

Compared with DDP: each step's logged values and returned loss averaged over the data-parallel ranks (the examples
log without ``sync_dist``, so what rank 0 logs is its own shard's; the average is the global batch's), predictions by
sample, the weights; with as many data-parallel ranks as DDP's (dp 2 ZeRO 0-3), also what rank 0 logged and what
``test`` returned, exactly as the example shows them. DDP is given ``find_unused_parameters=True`` where the example
needs it under DDP (GAN, DQN, PPO); ``HybridStrategy`` is given nothing.
"""

from __future__ import annotations

import functools
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, DemoModel, ManualOptimBoringModel
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from tests.helpers import conformance
from tests.helpers import lightning_examples as ex
from tests.helpers.conformance import DDP, EXAMPLE_CELLS, LAYOUTS, Cell
from tests.helpers.distributed import run_distributed
from tests.test_manual_optimization import GAN

_TIMEOUT = timedelta(seconds=120)


class GlobalMetrics(L.Callback):
    """After every training step: the values logged so far at this step and the loss the step returned, each
    averaged over the data-parallel ranks (DDP: every rank), and rank 0's own; at each epoch's end the same for the
    epoch's values. Every rank calls the reductions in the same order."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.rank0: list[dict[str, float]] = []

    def _record(self, trainer: L.Trainer, extra: dict[str, torch.Tensor]) -> None:
        values = {k: v for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
        values.update(extra)
        local = {k: float(v) for k, v in sorted(values.items())}
        self.rank0.append(local)
        reduced = {}
        for key, value in sorted(values.items()):
            reduced[key] = float(trainer.strategy.reduce(value.detach().clone().float(), reduce_op="mean"))
        self.steps.append(reduced)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._record(trainer, {"returned_loss": loss} if torch.is_tensor(loss) else {})

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, {})


# --------------------------------------------------------------------------------------------------- examples
def _boring(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    return BoringModel(), None, {"limit_train_batches": 8, "limit_val_batches": 4, "max_epochs": 1}


def _demo(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    return DemoModel(), BoringDataModule(), {"limit_train_batches": 8, "max_epochs": 1}


def _manual_boring(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    return ManualOptimBoringModel(), None, {"limit_train_batches": 8, "limit_val_batches": 4, "max_epochs": 1}


class OfflineTransformer(LightningTransformer):
    """The demo Transformer as it ships, but for ``prepare_data``, which downloads WikiText-2 (replaced here by
    synthetic token blocks of its shapes)."""

    @override
    def prepare_data(self) -> None:
        pass


def _transformer(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    data = ex.Tensors(ex.wikitext2, batch, samples=8)
    return OfflineTransformer(), data, {"max_steps": 3, "limit_val_batches": 0}


def _autoencoder(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    return ex.LitAutoEncoder(), ex.Tensors(ex.mnist, batch), {"max_epochs": 2, "evaluate_best": True}


def _classifier(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    return ex.LitClassifier(), ex.Tensors(ex.mnist, batch), {"max_epochs": 2, "evaluate_best": True}


def _gan(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    data = ex.Tensors(lambda n, g: (torch.rand(n, 1, 28, 28, generator=g) * 2 - 1, torch.zeros(n)), batch)
    return GAN(), data, {"max_epochs": 1, "limit_val_batches": 0}


def _dqn(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    return ex.DQNLightning(), None, {"max_steps": 8}


def _ppo(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    return ex.PPOLightning(batch_size=16, steps_per_epoch=32), None, {"max_epochs": 2}


def _finetuning(batch: int) -> tuple[L.LightningModule, Any, dict[str, Any]]:
    module = ex.TransferLearningModel(milestones=(1, 2), batch_size=batch)
    callbacks = [ex.MilestonesFinetuning(milestones=(1, 2))]
    return module, ex.Tensors(ex.cats_and_dogs, batch, samples=16), {"max_epochs": 3, "callbacks": callbacks}


# name -> (build(per-rank batch) -> (module, datamodule or None, trainer settings), global batch, DDP kwargs)
BUILD = {
    "boring": (_boring, None, {}),
    "demo": (_demo, None, {}),
    "manual_boring": (_manual_boring, None, {}),
    "transformer": (_transformer, 4, {}),
    "autoencoder": (_autoencoder, 16, {}),
    "classifier": (_classifier, 16, {}),
    "gan": (_gan, 16, {"find_unused_parameters": True}),
    "dqn": (_dqn, None, {"find_unused_parameters": True}),
    "ppo": (_ppo, None, {"find_unused_parameters": True}),
    "finetuning": (_finetuning, 8, {}),
}


def _strategy(name: str, layout: str) -> Any:
    from lightning_mgpu import HybridStrategy

    if layout == DDP:
        return DDPStrategy(timeout=_TIMEOUT, **BUILD[name][2])
    return HybridStrategy(timeout=_TIMEOUT, **LAYOUTS[layout].kwargs)


def _run(name: str, layout: str, world: int, tmp: Path) -> dict[str, Any]:
    """The example's main (fit; then test and predict from the best checkpoint where it does), this rank's view."""
    build, global_batch, _ = BUILD[name]
    dp = world if layout == DDP else LAYOUTS[layout].dp
    module, data, settings = build(global_batch // dp if global_batch else 1)
    settings = dict(settings)
    evaluate_best = settings.pop("evaluate_best", False)
    metrics = GlobalMetrics()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=_strategy(name, layout),
        logger=False,
        enable_checkpointing=evaluate_best,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp,
        **{**settings, "callbacks": [*settings.get("callbacks", []), metrics]},
    )
    try:
        trainer.fit(module, datamodule=data)
    except Exception as error:
        return {
            "error": f"{type(error).__name__}: {error}",
            "steps_before": len(metrics.steps),
            "trace": traceback.format_exc(),
        }
    out: dict[str, Any] = {
        "steps": metrics.steps,
        "rank0": metrics.rank0,
        "sampler": trainer.strategy.distributed_sampler_kwargs,
    }
    if evaluate_best:
        out["test"] = trainer.test(ckpt_path="best", datamodule=data, verbose=False)
        out["predictions"] = torch.cat(trainer.predict(ckpt_path="best", datamodule=data))
    out["weights"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return out


def _worker(jobs: list[tuple[str, str]], world: int, root: str) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for name, layout in jobs:
        L.seed_everything(1234, verbose=False)
        start = time.perf_counter()
        try:
            out[name, layout] = _run(name, layout, world, Path(root) / f"{name}-{layout}".replace(" ", "_"))
        except Exception:
            out[name, layout] = {"failed": traceback.format_exc()}
        if dist.get_rank() == 0:
            print(f"example {name} under {layout}: {time.perf_counter() - start:.1f} s", flush=True)
    return out


@functools.cache
def _job(world: int, slow: bool, root: str, alone: tuple[str, str] | None = None) -> dict[tuple[str, str], list[Any]]:
    """The tier's runs of this world size and their DDP references in one job; a known failure (``alone``) in its
    own job: a rank that fails after training started ends its process, and with it the job."""
    if alone is not None:
        jobs = [(alone[0], DDP), alone]  # the reference first: the failure may end the job
    else:
        tier = [
            c
            for c in EXAMPLE_CELLS
            if c.slow == slow and LAYOUTS[c.layout].world == world and c.expect not in ("known", "differs")
        ]
        jobs = sorted(
            {
                (c.subject, layout)
                for c in tier
                for layout in (c.layout, DDP)
                if layout == c.layout or c.expect == "equal"
            }
        )
    if not jobs:
        return {}
    directory = Path(root) / re.sub(r"\W+", "_", f"{world}-{slow}-{alone}")  # each job its own checkpoints
    per_rank = run_distributed(_worker, world, jobs, world, str(directory), timeout=900)
    return {key: [rank[key] for rank in per_rank] for key in jobs}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("examples"))


def _by_sample(per_rank: list[dict[str, Any]]) -> dict[int, torch.Tensor]:
    """Predictions by dataset index: replica ``r`` of ``R`` predicted samples ``r, r + R, ...`` (no shuffling)."""
    found: dict[int, torch.Tensor] = {}
    for result in per_rank:
        replicas, rank = result["sampler"]["num_replicas"], result["sampler"]["rank"]
        for j, row in enumerate(result["predictions"]):
            index = rank + j * replicas
            if index in found:
                torch.testing.assert_close(row, found[index], rtol=0, atol=0)  # tp/pp peers agree
            found[index] = row
    return found


@pytest.mark.parametrize("cell", conformance.params(EXAMPLE_CELLS))
def test_example_under_layout(cell: Cell, root: str) -> None:
    alone = (cell.subject, cell.layout) if cell.expect in ("known", "differs") else None
    job = _job(LAYOUTS[cell.layout].world, cell.slow, root, alone)
    ours = job[cell.subject, cell.layout]
    failed = [r["failed"] for r in ours if "failed" in r]
    assert not failed, failed[0]
    if cell.expect == "refused":  # every rank, before the first step
        for result in ours:
            assert "error" in result, f"{cell.subject} under {cell.layout} was not refused"
            assert re.search(cell.match, result["error"]), result["trace"]
            assert result["steps_before"] == 0, "refused after training started"
        print(f"\n{cell.subject} under {cell.layout}: refused: {ours[0]['error'][:160]}")
        return
    if cell.expect == "differs":  # trains, but not as DDP does, by construction: the difference is asserted
        _assert_ran(ours, job[cell.subject, DDP])  # a crash or a hang is no difference
        with pytest.raises(AssertionError) as difference:
            _assert_equal(cell, ours, job[cell.subject, DDP])
        print(f"\n{cell.subject} under {cell.layout}: differs: {str(difference.value).splitlines()[0][:160]}")
        return
    if cell.expect == "known":  # the failure it has, on the rank that failed first (the others report the loss)
        errors = [r["error"] for r in ours if "error" in r]
        assert errors, f"{cell.subject} under {cell.layout} ran: the known failure is gone, make the cell equal"
        assert any(re.search(cell.match, e) for e in errors), errors
        print(
            f"\n{cell.subject} under {cell.layout}: known: {next(e for e in errors if re.search(cell.match, e))[:160]}"
        )
        return
    print(f"\n{cell.subject} under {cell.layout}: equal; {_assert_equal(cell, ours, job[cell.subject, DDP])}")


def _assert_ran(ours: list[Any], reference: list[Any]) -> None:
    for side, results in (("ours", ours), ("DDP", reference)):
        errors = [r["trace"] for r in results if "error" in r]
        assert not errors, f"{side}: {errors[0]}"


def _assert_equal(cell: Cell, ours: list[Any], reference: list[Any]) -> str:
    _assert_ran(ours, reference)
    mine, theirs = ours[0], reference[0]
    conformance.assert_close_tree(mine["steps"], theirs["steps"], what="steps (averaged over dp)")
    conformance.assert_same_weights(mine["weights"], theirs["weights"])
    measured = [f"steps {conformance.worst_relative(mine['steps'], theirs['steps']):.1e}"]
    if LAYOUTS[cell.layout].dp == LAYOUTS[cell.layout].world:  # rank 0 holds DDP rank 0's samples
        conformance.assert_close_tree(mine["rank0"], theirs["rank0"], what="rank 0's logged values")
        if "test" in theirs:
            conformance.assert_close_tree(mine["test"], theirs["test"], what="test(ckpt_path='best')")
    if "predictions" in theirs:
        predictions, expected = _by_sample(ours), _by_sample(reference)
        conformance.assert_close_tree(predictions, expected, atol=conformance.PREDICTION_ATOL, what="predictions")
        measured.append(f"predictions {conformance.worst_absolute(predictions, expected):.1e} absolute")
    measured.append(f"weights {conformance.worst_absolute(mine['weights'], theirs['weights']):.1e} absolute")
    return ", ".join(measured)
