"""ScalingMonitor: the split of a step adds up to its wall time on every layout, data-bound runs are named, the
pipeline's bubble stands beside its theory, the report files are real, and every patch is undone."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_mgpu import HybridStrategy, ScalingMonitor
from lightning_mgpu.demo import GPTLightningModule, TextDataModule
from lightning_mgpu.monitor import FIELDS
from lightning_mgpu.monitor.diagnose import diagnose
from tests.helpers.distributed import run_distributed

STEPS = 5  # the first is warm-up: 4 measured steps
TOLERANCE = 0.05


class _StepEnds(Callback):
    """The test's own clock: when each step ended, to check the monitor's step walls against; and its loss."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends[batch_idx] = time.perf_counter()
        self.losses.append(float(outputs["loss"]))


class _SlowDataModule(TextDataModule):
    """The demo data with a DataLoader that sleeps ``delay`` seconds per batch."""

    def __init__(self, delay: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay = delay

    def train_dataloader(self):
        loader = super().train_dataloader()
        return _Sleepy(loader, self.delay)


class _Sleepy:
    def __init__(self, loader, delay: float) -> None:
        self.loader, self.delay = loader, delay

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            time.sleep(self.delay)
            yield batch


def _patched_objects() -> list:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.pipelining import schedules

    return [
        dist.all_reduce,
        dist.broadcast,
        dist.batch_isend_irecv,
        funcol.all_reduce,
        funcol.wait_tensor,
        schedules._batch_p2p,
        torch._C._distributed_c10d.Work.wait,
    ]


def _fit(
    out: Path, strategy="auto", devices: int = 1, delay: float = 0.0, logger=False, monitored: bool = True
) -> tuple[dict, dict, list]:
    L.seed_everything(7)
    kwargs = dict(batch_size=8, block_size=32)
    datamodule = _SlowDataModule(delay, **kwargs) if delay else TextDataModule(**kwargs)
    model = GPTLightningModule(block_size=32, n_layer=2, n_head=4, n_embd=32)
    monitor, ends = ScalingMonitor(dirpath=out, verbose=False), _StepEnds()  # the test's clock is read first
    callbacks = [ends, monitor] if monitored else [ends]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule)
    # The test clock's interval per step, for this rank.
    walls = {k: ends.ends[k] - ends.ends[k - 1] for k in ends.ends if k - 1 in ends.ends}
    return monitor.report, walls, ends.losses


def _layout_job(dp: int, tp: int, pp: int, out: str, lightning_strategy: str = "") -> dict:
    before = _patched_objects()
    strategy = lightning_strategy or HybridStrategy(
        data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp
    )
    report, walls, _ = _fit(Path(out), strategy, devices=dp * tp * pp)
    return {"report": report, "walls": walls, "restored": _patched_objects() == before}


def _check_split_adds_up(report: dict, walls: list[dict]) -> None:
    assert report["steps_measured"] == STEPS - 1
    for step in report["steps"]:
        parts = step["parts_s"]
        assert sum(parts.values()) == pytest.approx(step["wall_s"], rel=TOLERANCE)
        # No part is counted twice: what is left for compute, optimizer and the loop is not negative.
        assert min(parts.values()) >= -1e-4, parts
    # The monitor's step walls agree with the test's own clock (mean over ranks and measured steps).
    own = sum(w[step["step"]] for w in walls for step in report["steps"]) / len(walls)
    assert sum(step["wall_s"] for step in report["steps"]) == pytest.approx(own, rel=TOLERANCE)
    assert sum(report["time_split"]["fractions"].values()) == pytest.approx(1.0, rel=TOLERANCE)


def _check_files(out: Path) -> None:
    saved = json.loads((out / "scaling_report.json").read_text())
    assert set(FIELDS) <= set(saved) and saved["fields"] == FIELDS
    from PIL import Image

    with Image.open(out / "scaling_report.png") as image:
        image.load()
        width, height = image.size
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert width > 500 and height > 300
    assert colors is not None and len(colors) > 20  # bars, text and legends, not a blank canvas


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "axes"),
    [
        # The slow tier: each axis alone (the quick tier's 3D layout has all three in one run).
        pytest.param(2, 1, 1, {"dp"}, id="dp2", marks=pytest.mark.slow),
        pytest.param(1, 2, 1, {"tp"}, id="tp2", marks=pytest.mark.slow),
        pytest.param(1, 1, 2, {"pp"}, id="pp2", marks=pytest.mark.slow),
        pytest.param(2, 2, 2, {"dp", "tp", "pp"}, id="pp2xdp2xtp2"),
    ],
)
def test_split_adds_up_on_every_layout(tmp_path, dp, tp, pp, axes):
    results = run_distributed(_layout_job, dp * tp * pp, dp, tp, pp, str(tmp_path))
    report = results[0]["report"]
    assert all(r["restored"] for r in results), "a patch of torch.distributed outlived fit"
    _check_split_adds_up(report, [r["walls"] for r in results])
    exposed = {axis for axis, c in report["communication"].items() if c["exposed_s"] > 0}
    assert axes <= exposed, report["communication"]
    assert report["layout"] == {
        "data_parallel_size": dp,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "zero_stage": 0,
        "context_parallel_size": 1,
    }
    assert report["throughput"]["tokens_per_s"] > 0 and 0 < report["throughput"]["mfu"] < 1
    assert len(report["memory"]) == dp * tp * pp and all(m["parameters"] > 0 for m in report["memory"])
    assert all(m["activations"] > 0 and m["optimizer"] > 0 for m in report["memory"])
    if pp > 1:
        pipeline = report["pipeline"]
        assert pipeline["schedule"] == "1F1B" and pipeline["num_microbatches"] == 2
        assert pipeline["analytic_bubble"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1) with p=2, m=2
        assert 0 < pipeline["measured_bubble"] < 1
        assert report["time_split"]["parts_s"]["bubble"] > 0
    else:
        assert report["pipeline"] is None
    if (dp, tp, pp) == (2, 2, 2):
        _check_files(tmp_path)


def _context_parallel_job(out: str) -> dict:
    before = _patched_objects()
    report, walls, _ = _fit(Path(out), HybridStrategy(context_parallel_size=2), devices=2)
    return {"report": report, "walls": walls, "restored": _patched_objects() == before}


def test_context_parallel_ring_traffic_is_reported_as_comm_cp(tmp_path):
    """cp 2 (ring): the key/value blocks' sends and receives are the ``cp`` axis's communication, not a bubble."""
    results = run_distributed(_context_parallel_job, 2, str(tmp_path))
    report = results[0]["report"]
    assert all(r["restored"] for r in results)
    _check_split_adds_up(report, [r["walls"] for r in results])
    assert report["communication"]["cp"]["exposed_s"] > 0, report["communication"]
    assert report["time_split"]["parts_s"].get("bubble", 0.0) == 0.0
    assert report["layout"]["context_parallel_size"] == 2


def _same_training_job(out: str) -> tuple[list[float], list[float], bool]:
    def strategy() -> HybridStrategy:
        return HybridStrategy(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3)

    before = _patched_objects()
    *_, plain = _fit(Path(out), strategy(), devices=4, monitored=False)
    *_, monitored = _fit(Path(out), strategy(), devices=4)
    return plain, monitored, _patched_objects() == before


def test_training_is_unchanged_by_the_monitor(tmp_path):
    """dp2 x tp2 with ZeRO-3 (FSDP2's collectives, DTensor's functional collectives): the same losses step by step."""
    plain, monitored, restored = run_distributed(_same_training_job, 4, str(tmp_path))[0]
    assert restored
    assert len(plain) == STEPS and plain == monitored


def test_lightning_ddp_strategy(tmp_path):
    """Any strategy: Lightning's DDP (its gradient all-reduce runs in DDP's C++ reducer, out of the timers' sight:
    it is counted in compute; collectives issued from Python, such as the per-step stop-signal broadcast, are dp)."""
    results = run_distributed(_layout_job, 2, 2, 1, 1, str(tmp_path), "ddp")
    report = results[0]["report"]
    assert all(r["restored"] for r in results)
    _check_split_adds_up(report, [r["walls"] for r in results])
    assert report["strategy"] == "DDPStrategy" and report["layout"] is None and report["data_parallel_replicas"] == 2
    assert report["communication"]["dp"]["exposed_s"] > 0


def test_sleeping_dataloader_is_data_bound_and_the_same_run_without_sleep_is_not(tmp_path):
    """One process with Lightning's own strategy: the monitor needs no HybridStrategy. Metrics reach the logger."""
    from lightning.pytorch.loggers import CSVLogger

    fast, fast_walls, _ = _fit(tmp_path / "fast", logger=CSVLogger(tmp_path / "logs", name="", version=""))
    logged = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"scaling/step_s", "scaling/tokens_per_s", "scaling/share_compute", "scaling/share_data_wait"} <= set(logged)
    slow, slow_walls, _ = _fit(tmp_path / "slow", delay=0.05)
    for report, walls in ((fast, fast_walls), (slow, slow_walls)):
        _check_split_adds_up(report, [walls])
    assert slow["time_split"]["parts_s"]["data_wait"] >= 0.05
    assert "data_bound" in {d["kind"] for d in slow["diagnoses"]}
    assert "data_bound" not in {d["kind"] for d in fast["diagnoses"]}
    assert fast["time_split"]["fractions"]["data_wait"] < 0.2
    _check_files(tmp_path / "slow")


def _report(fractions: dict, **extra) -> dict:
    report = {"time_split": {"fractions": fractions}, "memory": [], "layout": None, "options": {}, "pipeline": None}
    report.update(extra)
    return report


def test_diagnoses_name_the_axis_the_bubble_and_the_memory_headroom():
    kinds = {d["kind"] for d in diagnose(_report({"compute": 0.5, "comm_tp": 0.4, "comm_dp": 0.1}))}
    assert kinds == {"communication_bound_tp"}
    pipeline = {
        "schedule": "GPipe",
        "pp": 4,
        "stages": 4,
        "num_microbatches": 4,
        "measured_bubble": 0.7,
        "analytic_bubble": 3 / 7,
    }
    found = diagnose(_report({"compute": 1.0}, pipeline=pipeline))
    assert [d["kind"] for d in found] == ["bubble_above_theory"] and "num_microbatches (e.g. 8)" in found[0]["change"]
    memory = [{"rank": 0, "peak": 10, "capacity": 100}]
    found = diagnose(
        _report({"compute": 1.0}, memory=memory, layout={"zero_stage": 3}, options={"activation_checkpointing": "full"})
    )
    assert [d["kind"] for d in found] == ["memory_headroom"]
    assert "activation_checkpointing off" in found[0]["change"] and "zero_stage=2" in found[0]["change"]
    tight = diagnose(_report({"compute": 1.0}, memory=[{"rank": 0, "peak": 95, "capacity": 100}]))
    assert [d["kind"] for d in tight] == ["memory_tight"]


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"warmup_steps": -1}, {"peak_flops": 0.0}])
def test_bad_arguments_are_refused_with_the_value(kwargs):
    name, _ = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=name):
        ScalingMonitor(**kwargs)
