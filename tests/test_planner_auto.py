"""``"auto"`` tensor/pipeline sizes and ZeRO stage: the candidates the options allow (checked when the ``Trainer`` is
built), the planner's choice at setup with the real module, and a CPU run that trains as one process does and logs
the prediction beside the measured step time."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest

from lightning_mgpu import HybridStrategy
from lightning_mgpu.demo import GPTLightningModule
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.planner import ClusterSpec, build_on_meta
from lightning_mgpu.planner.auto import batch_per_replica, layout_candidates, local_cluster, plan_strategy_layout
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import CNNModule, RandomTokenDataModule

GPT = dict(block_size=32, n_layer=4, n_head=4, n_embd=32)
AUTO = dict(tensor_parallel_size="auto", pipeline_parallel_size="auto", zero_stage="auto")


def _trainer(strategy: HybridStrategy, devices: int = 4) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False)


def test_candidates_cover_every_layout_the_auto_choices_allow():
    choices = layout_candidates(4, "auto", "auto", "auto", "auto")
    sizes = {(c.data_parallel_size, c.tensor_parallel_size, c.pipeline_parallel_size) for c in choices}
    assert sizes == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 1, 4), (1, 2, 2)}
    assert choices[0].describe() == "dp=4 x tp=1 x pp=1 (zero_stage=0)"  # the rule without a model comes first
    assert all(c.zero_stage == 0 for c in choices if c.data_parallel_size == 1)  # nothing to shard at dp=1
    assert not [c for c in choices if c.zero_stage >= 2 and c.pipeline_parallel_size > 1]
    fixed = layout_candidates(8, "auto", 2, "auto", 3)
    assert {(c.tensor_parallel_size, c.zero_stage) for c in fixed} == {(2, 3)} and len(fixed) == 3
    with pytest.raises(ValueError, match=r"`zero_stage` must be one of .* or 'auto' \(the planner chooses\), got 'x'"):
        HybridStrategy(zero_stage="x")


def test_auto_choices_are_checked_against_the_options_when_the_trainer_is_built():
    strategy = HybridStrategy(**AUTO)
    _trainer(strategy)
    assert len(strategy._layout_choices) == 13
    with pytest.raises(RuntimeError, match="planner chooses among 'auto' layouts"):
        strategy.layout  # noqa: B018 - chosen at setup, with the module
    # Options narrow the choice: cpu_offload needs ZeRO-3, sequence parallelism tp > 1.
    strategy = HybridStrategy(zero_stage="auto", cpu_offload=True)
    assert _trainer(strategy, devices=2).strategy.layout.zero_stage == 3
    strategy = HybridStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto", sequence_parallel=True)
    _trainer(strategy, devices=2)
    assert [c.tensor_parallel_size for c in strategy._layout_choices] == [2]
    # No candidate runs: every candidate's reason, before any process starts.
    strategy = HybridStrategy(
        tensor_parallel_size="auto", pipeline_parallel_size="auto", sequence_parallel=True, num_microbatches=4
    )
    with pytest.raises(
        ValueError,
        match=r"(?s)No layout the 'auto' sizes allow on 2 processes runs with these"
        r" options:\n- dp=2 x tp=1 x pp=1.*`sequence_parallel=True`.*"
        r"\n- dp=1 x tp=2 x pp=1 \(zero_stage=0\): `num_microbatches=4`",
    ):
        _trainer(strategy, devices=2)


def test_the_planner_picks_the_fastest_layout_that_fits_and_says_why_not_otherwise():
    module = build_on_meta(GPTLightningModule, GPT)
    choices = layout_candidates(4, "auto", "auto", "auto", "auto")
    roomy = plan_strategy_layout(module, choices, local_cluster(4, 4), 2, "32-true", ParallelOptions())
    assert roomy.estimate is not None and roomy.estimate.fits and roomy.layout in choices
    assert roomy.estimate.layout.dp == roomy.layout.data_parallel_size and roomy.batch_per_replica == 2
    # Memory for about half the replicated model's states: only sharded or split layouts fit.
    replicated = plan_strategy_layout(module, choices[:1], local_cluster(4, 4), 2, "32-true", ParallelOptions())
    full = replicated.estimate.memory["total"]
    tight = ClusterSpec(
        gpus=4,
        gpus_per_node=4,
        memory_gb=0.8 * full / 2**30,
        peak_tflops=0.02,
        intra_node_gbps=1,
        inter_node_gbps=0.1,
        hbm_gbps=10,
        reserved_gb=0,
    )
    chosen = plan_strategy_layout(module, choices, tight, 2, "32-true", ParallelOptions())
    assert chosen.estimate.fits and chosen.estimate.memory["total"] < full
    assert chosen.layout != choices[0] and "predicted" in chosen.describe()
    none = ClusterSpec(
        gpus=4, gpus_per_node=4, memory_gb=1e-5, peak_tflops=1, intra_node_gbps=1, inter_node_gbps=1, reserved_gb=0
    )
    with pytest.raises(ValueError, match=r"found no layout for GPTLightningModule.*needs .* GB per GPU"):
        plan_strategy_layout(module, choices, none, 2, "32-true", ParallelOptions())
    # A module without a list of repeated blocks: the rule without a model, and a warning that says why.
    fallback = plan_strategy_layout(CNNModule(), choices, local_cluster(4, 4), 2, "32-true", ParallelOptions())
    assert fallback.layout == choices[0] and fallback.estimate is None
    assert "fall back to dp=4 x tp=1 x pp=1 (zero_stage=0) because CNNModule has no list of repeated blocks" in (
        fallback.describe()
    )


def test_the_batch_size_is_read_from_the_datamodule_or_the_loader():
    module = GPTLightningModule(**GPT)
    trainer = _trainer(HybridStrategy(**AUTO))
    assert batch_per_replica(module) is None
    trainer.fit_loop._data_source.instance = RandomTokenDataModule(batch_size=6).train_dataloader()
    module._trainer = trainer
    assert batch_per_replica(module) == 6


class PlanProbe(L.Callback):
    """Keeps the strategy's plan and the messages Lightning's logger printed, as this rank saw them."""

    def __init__(self) -> None:
        self.records: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.records.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("lightning.pytorch").addHandler(self.handler)  # before fit: the plan is logged at setup
        self.strategy: Any = None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.strategy = trainer.strategy
        logging.getLogger("lightning.pytorch").removeHandler(self.handler)

    @property
    def results(self) -> dict[str, Any]:
        plan = self.strategy.plan
        return {
            "logs": self.records,
            "layout": plan.layout,
            "predicted": plan.predicted_step_s,
            "measured": plan.step_clock.mean(),
        }


@pytest.mark.parametrize(
    ("devices", "sizes"), [(4, AUTO), (2, dict(data_parallel_size=1, **AUTO))], ids=["all-auto-4", "tp-or-pp-2"]
)
def test_auto_sizes_choose_a_valid_layout_train_as_one_process_and_log_the_prediction(devices, sizes):
    per_rank = 2
    result, extras = fit(
        lambda: GPTLightningModule(**GPT, lr=1e-3),
        lambda: RandomTokenDataModule(vocab_size=256, seq_len=32, batch_size=per_rank),
        strategy_kwargs=sizes,
        devices=devices,
        max_steps=4,
        callbacks_factory=lambda: [PlanProbe()],
    )
    layouts = {extra["layout"] for extra in extras}
    assert len(layouts) == 1  # every rank runs rank 0's choice
    layout = layouts.pop()
    assert layout.world_size == devices and layout in layout_candidates(
        devices,
        *(
            sizes.get(name, "auto")
            for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "zero_stage")
        ),
    )
    dp = layout.data_parallel_size
    reference, _ = fit(
        lambda: GPTLightningModule(**GPT, lr=1e-3),
        lambda: RandomTokenDataModule(vocab_size=256, seq_len=32, batch_size=per_rank * dp),
        devices=1,
        max_steps=4,
    )
    assert_same_training(reference, result)
    rank0 = extras[0]
    planned = [m for m in rank0["logs"] if m.startswith(f"HybridStrategy planned {layout.describe()}: predicted")]
    assert planned and f"at {per_rank} sequence(s) per data-parallel rank" in planned[0]
    assert rank0["predicted"] > 0 and rank0["measured"] > 0
    beside = f"measured {rank0['measured']:.4g} s per step, the planner predicted {rank0['predicted']:.4g} s"
    assert any(beside in message for message in rank0["logs"]), rank0["logs"]
    assert not any("HybridStrategy" in message for extra in extras[1:] for message in extra["logs"])  # rank 0 only
