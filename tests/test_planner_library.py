"""The planner agrees with the library: every layout ``lightning-mgpu plan`` ranks for a model is one
``HybridStrategy`` runs for it, and the call it prints builds exactly that strategy.

Over a grid of models (heads, key/value heads, layers, vocabulary, experts) and cluster sizes, each ranked layout's
printed ``HybridStrategy(...)`` call is evaluated and given to a ``Trainer`` (the checks of the launching process),
the strategy it built compared with the ranked layout, and the strategy's own setup run on the real module (built
on the meta device, on torch's fake process group: ``rehearsal.rehearse_rank``) for its first and last
ranks, where setup checks the module (sharded sizes, the pipeline cut, the experts). The setups run in a forked
process per case: a fake process group leaves state behind that later forked jobs of this worker would inherit.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any

import lightning as L
import pytest
import yaml

from examples.rehearse.llama import LlamaLM
from examples.rehearse.mixtral import MixtralLM
from lightning_mgpu import HybridStrategy, ParallelLayout
from lightning_mgpu.demo import GPTLightningModule
from lightning_mgpu.parallel import pipeline
from lightning_mgpu.planner import Training, build_on_meta, parse_fix, preset, recipe, search, spec_from_module
from lightning_mgpu.rehearsal import rehearse_rank
from tests.helpers.distributed import run_distributed
from tests.helpers.tiers import case


def _llama(heads: int, kv_heads: int, layers: int, vocab: int, hidden: int = 64) -> tuple[type, dict]:
    shapes = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab)
    return LlamaLM, shapes | dict(hidden_size=hidden, intermediate_size=hidden * 3 // 2, max_position_embeddings=64)


MIXTRAL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
# name: (class, keyword arguments): heads, key/value heads, layers and vocabularies that divide differently
MODELS = {
    "llama-h8-kv2-l4-v96": _llama(8, 2, 4, 96),
    "llama-h4-kv4-l6-v100": _llama(4, 4, 6, 100),
    "llama-h6-kv3-l3-v90": _llama(6, 3, 3, 90, hidden=48),
    "gpt-h4-l4": (GPTLightningModule, dict(vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=32)),
    "mixtral-e4": (MixtralLM, MIXTRAL | dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(autouse=True)
def _quiet():
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def _built(layout, cluster, training) -> L.Trainer:
    """The ranked layout's printed call, evaluated, in a Trainer with the printed Trainer arguments (on CPU)."""
    strategy = eval(recipe.strategy_call(layout, training), {"HybridStrategy": HybridStrategy})
    arguments = recipe.trainer_kwargs(layout, cluster, training) | {"accelerator": "cpu"}
    return L.Trainer(
        strategy=strategy, logger=False, enable_checkpointing=False, enable_progress_bar=False, **arguments
    )


def _assert_runs_as_ranked(layout, cluster, training) -> tuple[ParallelLayout, Any]:
    """The printed call builds the ranked layout; returns what the strategy's setup is to run with."""
    trainer = _built(layout, cluster, training)
    strategy = trainer.strategy
    sizes = replace(strategy.layout, expert_parallel_size=1, data_parallel_shard_size=None)
    assert sizes == ParallelLayout(layout.dp, layout.tp, layout.pp, layout.zero_stage, layout.cp)
    options = strategy.options
    assert options.global_batch_size == training.global_batch
    assert options.activation_checkpointing == layout.options.activation_checkpointing
    assert options.sequence_parallel == (layout.options.sequence_parallel and layout.tp > 1)
    assert strategy.layout.expert_parallel_size == layout.ep
    assert (strategy.layout.data_parallel_shard_size or layout.gradient_ranks) == layout.shard
    if layout.pp > 1:
        planned = (layout.options.pipeline_schedule, layout.microbatching.count)
        assert (options.pipeline_schedule, options.num_microbatches) == planned
    block = yaml.safe_load(recipe.cli_yaml(layout, cluster, training))["trainer"]
    assert block["strategy"]["init_args"] == recipe.strategy_kwargs(layout, training)
    assert trainer.num_devices * trainer.num_nodes == layout.world_size
    return strategy.layout, options


def _set_up_each(name: str, runs: list[tuple[ParallelLayout, Any]]) -> list[str]:
    """In a forked process: the strategy's setup of the real module for the first and last rank of each run (they
    hold the embedding and the head); what it refuses, by layout."""
    cls, kwargs = MODELS[name]
    refused = []
    for layout, options in runs:
        for rank in sorted({0, layout.world_size - 1}):
            try:
                rehearse_rank(lambda: cls(**kwargs), layout, options, rank)
            except (ValueError, NotImplementedError) as error:
                refused.append(f"{layout.describe()} rank {rank}: {error}")
    return refused


GRID = [
    case("llama-h8-kv2-l4-v96", 8, {}, id="llama-kv2-8"),
    case("llama-h4-kv4-l6-v100", 4, {}, id="llama-v100-4", slow=True),
    case("gpt-h4-l4", 4, {}, id="gpt-4"),
    case("mixtral-e4", 8, {"ep": 4, "tp": 1}, id="mixtral-ep4-8"),
    case("llama-h8-kv2-l4-v96", 16, {}, id="llama-kv2-16", slow=True),
    case("llama-h4-kv4-l6-v100", 8, {}, id="llama-v100-8", slow=True),
    case("llama-h6-kv3-l3-v90", 6, {}, id="llama-h6-6", slow=True),
    case("gpt-h4-l4", 8, {}, id="gpt-8", slow=True),
    case("mixtral-e4", 8, {"ep": 2}, id="mixtral-ep2-8", slow=True),
    case("mixtral-e4", 4, {}, id="mixtral-4", slow=True),
]


@pytest.mark.parametrize(("name", "gpus", "fixed"), GRID)
def test_every_ranked_layout_runs_as_printed(name, gpus, fixed):
    cls, kwargs = MODELS[name]
    spec = spec_from_module(build_on_meta(cls, kwargs))
    cluster, training = preset("h100-sxm", gpus=gpus), Training(global_batch=4 * gpus)
    plan = search(spec, cluster, training, fixed={**parse_fix(",".join(f"{k}={v}" for k, v in fixed.items()))})
    assert plan.ranked, plan.rejected[:3]
    runs = [_assert_runs_as_ranked(estimate.layout, cluster, training) for estimate in plan.ranked]
    assert run_distributed(_set_up_each, 1, name, runs)[0] == []


def test_grouped_query_heads_refuse_tp_beyond_them_in_the_strategys_words():
    """``--heads 32 --kv-heads 2 --fix tp=8`` was ranked as fitting; the library refuses tp 8 for 2 key/value heads,
    and so does the planner now, with the same check's message."""
    cls, kwargs = MODELS["llama-h8-kv2-l4-v96"]
    spec = spec_from_module(build_on_meta(cls, kwargs))
    cluster, training = preset("h100-sxm", gpus=8), Training(global_batch=32)
    plan = search(spec, cluster, training, fixed=parse_fix("tp=8"))
    assert not plan.ranked
    said = "tensor_parallel_size=8 must divide every sharded size, but: "
    assert any(said in reason and "the model's config.num_key_value_heads = 2" in reason for reason in plan.rejected)
    with pytest.raises(ValueError) as refused:
        rehearse_rank(
            lambda: cls(**kwargs), ParallelLayout(1, 8, 1, 0), HybridStrategy(tensor_parallel_size=8).options, 0
        )
    assert said in str(refused.value) and "the model's config.num_key_value_heads = 2" in str(refused.value)


def test_zero_at_one_data_parallel_rank_is_planned_with_the_strategys_warning():
    """``--fix tp=8,zero=1`` on 8 GPUs said "no candidate matches --fix"; the strategy runs it (as ZeRO 0) and
    warns, and the planner ranks it and prints the same warning."""
    cls, kwargs = MODELS["llama-h8-kv2-l4-v96"]
    spec = spec_from_module(build_on_meta(cls, dict(kwargs, num_key_value_heads=8)))
    cluster, training = preset("h100-sxm", gpus=8), Training(global_batch=32)
    plan = search(spec, cluster, training, fixed=parse_fix("tp=8,zero=1"))
    assert plan.best is not None and (plan.best.layout.tp, plan.best.layout.zero_stage) == (8, 1)
    (said,) = recipe.warnings_for(plan.best.layout, cluster)
    with pytest.warns(UserWarning) as caught:
        warnings.simplefilter("always")
        _built(plan.best.layout, cluster, training)
    assert said in [str(w.message) for w in caught]


@pytest.mark.parametrize("schedule", pipeline.PIPELINE_SCHEDULES)
def test_every_schedule_and_fp8_can_be_planned(schedule):
    cls, kwargs = MODELS["llama-h4-kv4-l6-v100"]
    spec = spec_from_module(build_on_meta(cls, dict(kwargs, num_hidden_layers=8)))
    cluster, training = preset("h100-sxm", gpus=8), Training(global_batch=32, precision="fp8-mixed")
    plan = search(spec, cluster, training, fixed=parse_fix(f"pp=2,tp=1,schedule={schedule}"))
    assert plan.best is not None, plan.rejected[:3]
    assert recipe.strategy_kwargs(plan.best.layout, training)["pipeline_schedule"] == schedule
