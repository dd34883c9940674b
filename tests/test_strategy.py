"""HybridStrategy's Lightning face: argument validation, registry, precision selection, collectives, launch."""

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_mgpu  # noqa: F401  (registers the strategy names)
from lightning_mgpu import HybridPrecision, HybridStrategy
from lightning_mgpu.parallel.data.wrap import reduce_metrics_over
from tests.helpers.distributed import run_distributed


def _trainer(devices=2, **kwargs):
    return L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(zero_stage=5), r"`zero_stage` must be one of \(0, 1, 2, 3\).*got 5"),
        (dict(zero_stage=-1), "zero_stage.*got -1"),
        (dict(data_parallel_size=0), "`data_parallel_size` must be a positive integer or 'auto', got 0"),
        (dict(tensor_parallel_size=-1), "tensor_parallel_size.*got -1"),
        (dict(pipeline_parallel_size="two"), "pipeline_parallel_size.*got 'two'"),
        (dict(zero_backend="megatron"), "`zero_backend` must be one of 'torch', 'deepspeed', got 'megatron'"),
        (dict(pipeline_schedule="ZeroBubble"), "`pipeline_schedule` must be one of 'GPipe', '1F1B'.*got 'ZeroBubble'"),
        (dict(checkpoint_format="zip"), "`checkpoint_format` must be one of 'sharded', 'full', got 'zip'"),
        (dict(tp_plan="magic"), "`tp_plan` must be 'auto', a dict.*got 'magic'"),
        (dict(pipeline_split="middle"), "`pipeline_split` must be 'auto' or a list.*got 'middle'"),
        (dict(num_microbatches=0), "`num_microbatches` must be a positive integer or None, got 0"),
        (dict(stages_per_rank=0), "`stages_per_rank` must be a positive integer or None, got 0"),
        (dict(activation_checkpointing="some"), "`activation_checkpointing` must be.*got 'some'"),
        (dict(cpu_offload="yes"), "`cpu_offload` must be True or False, got 'yes'"),
        (dict(loss_parallel="yes", tensor_parallel_size=2), "`loss_parallel` must be True or False, got 'yes'"),
        (dict(loss_parallel=True), "`loss_parallel=True`.*needs tensor_parallel_size > 1, got 1"),
        (dict(start_method="thread"), "`start_method` must be one of.*got 'thread'"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridStrategy(**kwargs)


@pytest.mark.parametrize(
    ("devices", "kwargs", "match"),
    [
        (
            4,
            dict(data_parallel_size=2),
            "data_parallel_size=2 x tensor_parallel_size=1 x pipeline_parallel_size=1 = 2"
            " processes, but the Trainer has 4",
        ),
        (2, dict(data_parallel_size=4), "= 4 processes, but the Trainer has 2"),
    ],
)
def test_layout_that_does_not_cover_the_devices_fails_when_the_trainer_is_built(devices, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _trainer(devices=devices, strategy=HybridStrategy(**kwargs))


@pytest.mark.parametrize(
    ("name", "stage"),
    [("hybrid", 0), ("hybrid_zero0", 0), ("hybrid_zero1", 1), ("hybrid_zero2", 2), ("hybrid_zero3", 3)],
)
def test_registered_names(name, stage):
    assert name in StrategyRegistry
    trainer = _trainer(strategy=name)
    assert isinstance(trainer.strategy, HybridStrategy)
    assert trainer.strategy.layout.zero_stage == stage
    assert trainer.strategy.layout.data_parallel_size == 2


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("32-true", "32-true"),
        ("bf16-mixed", "bf16-mixed"),
        ("bf16-true", "bf16-true"),
        ("16-mixed", "bf16-mixed"),  # Lightning's CPU choice, which it warns about (asserted below)
        (HybridPrecision("bf16-mixed"), "bf16-mixed"),
        (HybridPrecision("16-mixed"), "16-mixed"),  # fp16 with loss scaling on CPU: the explicit plugin
    ],
)
def test_trainer_precision_selects_hybrid_precision(precision, expected):
    """The precision is the one Lightning's plugin carries: read from the plugin handed over, no call stack."""
    kwargs = {"plugins": [precision]} if isinstance(precision, HybridPrecision) else {"precision": precision}
    if precision == "16-mixed":
        with pytest.warns(UserWarning, match=r"precision='16-mixed'.*Using `precision='bf16-mixed'` instead"):
            trainer = _trainer(strategy=HybridStrategy(), **kwargs)
    else:
        trainer = _trainer(strategy=HybridStrategy(), **kwargs)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, HybridPrecision)
    assert plugin.precision == expected and plugin.device_type == "cpu"
    assert (plugin.scaler is not None) == (expected == "16-mixed")
    # The same plugin handed over outside the Trainer's construction translates the same (nothing read elsewhere).
    lightning_plugin = _trainer(devices=1, **kwargs).precision_plugin if isinstance(precision, str) else precision
    assert HybridPrecision.handed_over(lightning_plugin, trainer.accelerator).precision == expected


def test_unsupported_precision_is_named():
    with pytest.raises(ValueError, match="does not support the precision '64-true'"):
        _trainer(strategy=HybridStrategy(), precision="64-true").strategy.precision_plugin  # noqa: B018 - raises


def _collectives_worker():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from torchmetrics import SumMetric

    strategy = HybridStrategy(zero_stage=1)
    trainer = _trainer(strategy=strategy)
    strategy.setup_environment()
    rank = strategy.global_rank
    value = torch.tensor(float(rank + 1))
    metric = SumMetric()
    metric.update(value)
    reduce_metrics_over(metric, strategy.device_mesh["dp"].get_group())
    return {
        "env": type(trainer.strategy.cluster_environment) is LightningEnvironment,
        "sampler": strategy.distributed_sampler_kwargs,
        "mean": float(strategy.reduce(value.clone())),
        "sum": float(strategy.reduce(value.clone(), reduce_op="sum")),
        "gathered": strategy.all_gather(value).tolist(),
        "broadcast": strategy.broadcast(f"from {rank}", src=1),
        "metric": float(metric.compute()),
    }


def test_collectives_and_sampler_use_the_data_parallel_group():
    out = run_distributed(_collectives_worker, 2, timeout=120)
    for rank, result in enumerate(out):
        assert result["sampler"] == {"num_replicas": 2, "rank": rank}
        assert result["mean"] == 1.5 and result["sum"] == 3.0
        assert result["gathered"] == [1.0, 2.0]
        assert result["broadcast"] == "from 1"
        assert result["metric"] == 3.0


def _vote_worker():
    strategy = HybridStrategy(tensor_parallel_size=2)
    _trainer(strategy=strategy)
    strategy.setup_environment()
    rank = strategy.global_rank
    return {
        "all_agree": strategy.reduce_boolean_decision(True),
        "one_disagrees": strategy.reduce_boolean_decision(rank == 0),
        "any": strategy.reduce_boolean_decision(rank == 0, all=False),
        "sum_over_dp": float(strategy.reduce(torch.tensor(1.0), reduce_op="sum")),  # dp group of size 1
    }


def test_checkpoint_and_early_stopping_votes_count_every_rank():
    """ModelCheckpoint/EarlyStopping compare the vote with the world size, though `reduce` defaults to dp."""
    for result in run_distributed(_vote_worker, 2, timeout=120):
        assert result == {"all_agree": True, "one_disagrees": False, "any": True, "sum_over_dp": 1.0}
