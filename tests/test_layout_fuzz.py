"""Layout fuzzing: any valid (dp, tp, pp, ZeRO, schedule, microbatches, precision) trains like one process.

Hypothesis draws layouts for worlds of 2 and 4 processes and a model from the test zoo, and each draw is compared
with plain Lightning on one process (same seed, same global batches). CI runs a few draws from a fixed seed; a
larger search runs with ``LMGPU_FUZZ_EXAMPLES=200 python -m pytest -m slow tests/test_layout_fuzz.py`` (random seeds;
``--hypothesis-seed=N`` replays one).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_mgpu.demo import GPTLightningModule
from lightning_mgpu.parallel.pipeline import PIPELINE_SCHEDULES
from lightning_mgpu.parallel.pipeline.microbatches import microbatch_count_error
from lightning_mgpu.parallel.pipeline.plan import stages_per_rank
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import GPT2Module, LlamaModule, RandomTokenDataModule

GLOBAL_BATCH = 8
STEPS = 4
EXAMPLES = int(os.environ.get("LMGPU_FUZZ_EXAMPLES", "0"))
# (loss rtol, weight atol) against one process of the same precision. Under bf16 a reduction-order difference can
# flip the sign of a near-zero AdamW update (lr 1e-3 x 4 steps): weights then differ by up to 2 x lr x steps.
TOLERANCE = {"32-true": (1e-5, 1e-4), "bf16-mixed": (2e-4, 8e-3)}

ZOO = {  # name: (factory, blocks, heads and kv heads allow tp 2)
    "demo-gpt": (lambda: GPTLightningModule(block_size=32, n_layer=4, n_head=4, n_embd=32, lr=1e-3), 4),
    "llama": (LlamaModule, 2),
    "gpt2-tied": (lambda: GPT2Module(tie_word_embeddings=True), 2),
}


@st.composite
def layouts(draw):
    model = draw(st.sampled_from(sorted(ZOO)))
    blocks = ZOO[model][1]
    world = draw(st.sampled_from([2, 4]))
    pp = draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0 and d <= blocks]))
    tp = draw(st.sampled_from([d for d in (1, 2) if (world // pp) % d == 0]))
    dp = world // (pp * tp)
    strategy = {"pipeline_parallel_size": pp, "tensor_parallel_size": tp, "zero_stage": draw(st.integers(0, 3))}
    if pp > 1:
        schedules = [s for s in PIPELINE_SCHEDULES if pp * stages_per_rank(s, None) <= blocks]
        schedule = draw(st.sampled_from(schedules))
        num_stages = pp * stages_per_rank(schedule, None)
        per_rank_batch = GLOBAL_BATCH // dp
        counts = [
            m
            for m in (1, 2, 4, 8)
            if per_rank_batch % m == 0 and microbatch_count_error(schedule, m, pp, num_stages) is None
        ]
        strategy.update(pipeline_schedule=schedule, num_microbatches=draw(st.sampled_from(counts)))
    precision = draw(st.sampled_from(sorted(TOLERANCE)))
    return model, strategy, world, dp, precision


_references: dict = {}


def _check(model: str, strategy: dict, world: int, dp: int, precision: str) -> None:
    factory = ZOO[model][0]
    trainer_kwargs = {"precision": precision}
    key = (model, precision)
    if key not in _references:
        _references[key] = fit(
            factory,
            lambda: RandomTokenDataModule(batch_size=GLOBAL_BATCH),
            None,
            1,
            STEPS,
            trainer_kwargs=trainer_kwargs,
        )[0]
    result, _ = fit(
        factory,
        lambda: RandomTokenDataModule(batch_size=GLOBAL_BATCH // dp),
        strategy,
        world,
        STEPS,
        trainer_kwargs=trainer_kwargs,
    )
    loss_rtol, weight_atol = TOLERANCE[precision]
    assert_same_training(_references[key], result, loss_rtol=loss_rtol, weight_rtol=1e-3, weight_atol=weight_atol)


@settings(
    max_examples=EXAMPLES or 6,
    derandomize=not EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@pytest.mark.slow  # the slow tier: layouts drawn beyond the fixed ones each parallelism's tests train
@given(layouts())
def test_any_valid_layout_trains_like_one_process(drawn):
    model, strategy, world, dp, precision = drawn
    print(f"fuzz: {model} {strategy} world={world} dp={dp} {precision}")
    _check(model, strategy, world, dp, precision)


def test_the_fuzzer_draws_every_dimension():
    """The drawing itself: over many draws every schedule, ZeRO stage, degree and precision comes up."""
    seen: dict[str, set] = {"schedule": set(), "zero": set(), "pp": set(), "tp": set(), "dp": set(), "precision": set()}

    @settings(max_examples=300, derandomize=True, deadline=None, database=None)
    @given(layouts())
    def draw(drawn):
        _model, strategy, world, dp, precision = drawn
        assert strategy["pipeline_parallel_size"] * strategy["tensor_parallel_size"] * dp == world
        seen["schedule"].add(strategy.get("pipeline_schedule"))
        seen["zero"].add(strategy["zero_stage"])
        seen["pp"].add(strategy["pipeline_parallel_size"])
        seen["tp"].add(strategy["tensor_parallel_size"])
        seen["dp"].add(dp)
        seen["precision"].add(precision)

    draw()
    assert seen["schedule"] >= set(PIPELINE_SCHEDULES)
    assert seen["zero"] == {0, 1, 2, 3} and seen["pp"] == {1, 2, 4} and seen["tp"] == {1, 2}
    assert seen["dp"] == {1, 2, 4} and seen["precision"] == set(TOLERANCE)


@pytest.mark.parametrize("model", sorted(ZOO))
def test_zoo_models_are_what_the_fuzzer_assumes(model):
    factory, blocks = ZOO[model]
    from lightning_mgpu.parallel.blocks import find_blocks

    assert len(find_blocks(factory())) == blocks
    assert torch.get_default_dtype() == torch.float32
