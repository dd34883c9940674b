"""Every invalid configuration fails at the earliest point that can tell, once, with the bad value and a fix.

The points: ``HybridStrategy(...)`` (``construct``), ``Trainer(...)`` when the world size, the devices and the
precision become known (``trainer``), and the strategy's ``setup`` in the workers, for what needs the model
(``setup``). Nothing that can be checked before launch may reach a worker process.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import warnings
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision
from torch import nn

from lightning_mgpu import HybridPrecision, HybridStrategy
from lightning_mgpu.options import LaunchOptions
from lightning_mgpu.parallel.pipeline import PIPELINE_SCHEDULES
from tests.helpers.distributed import run_distributed
from tests.helpers.modules import LlamaModule, RandomTokenDataModule

PP2 = dict(pipeline_parallel_size=2)
TP2 = dict(tensor_parallel_size=2)
FP8 = HybridPrecision("fp8-mixed", fp8_emulate=True)


def _noop_plan(module, tp_mesh):
    pass


# (id, HybridStrategy kwargs, Trainer kwargs, where it fails, message regex). The Trainer runs on 2 CPU devices
# unless its kwargs say otherwise.
CASES = [
    # --- sizes and ZeRO stage: HybridStrategy(...)
    ("zero-stage-5", dict(zero_stage=5), {}, "construct", r"`zero_stage` must be one of \(0, 1, 2, 3\).*got 5"),
    ("zero-stage-bool", dict(zero_stage=True), {}, "construct", r"`zero_stage` must be one of.*got True"),
    ("zero-stage-str", dict(zero_stage="3"), {}, "construct", r"`zero_stage` must be one of.*got '3'"),
    ("zero-stage-negative", dict(zero_stage=-1), {}, "construct", r"`zero_stage` must be one of.*got -1"),
    (
        "dp-0",
        dict(data_parallel_size=0),
        {},
        "construct",
        r"`data_parallel_size` must be a positive integer or 'auto', got 0",
    ),
    ("dp-none", dict(data_parallel_size=None), {}, "construct", r"`data_parallel_size` must be .*got None"),
    ("tp-negative", dict(tensor_parallel_size=-1), {}, "construct", r"`tensor_parallel_size` must be .*got -1"),
    ("tp-float", dict(tensor_parallel_size=2.0), {}, "construct", r"`tensor_parallel_size` must be .*got 2\.0"),
    ("pp-str", dict(pipeline_parallel_size="2"), {}, "construct", r"`pipeline_parallel_size` must be .*got '2'"),
    ("pp-bool", dict(pipeline_parallel_size=True), {}, "construct", r"`pipeline_parallel_size` must be .*got True"),
    ("pp-word", dict(pipeline_parallel_size="two"), {}, "construct", r"`pipeline_parallel_size` must be .*got 'two'"),
    # --- option values
    (
        "find-unused-str",
        dict(find_unused_parameters="yes"),
        {},
        "construct",
        r"`find_unused_parameters` must be None \(decided by the first step\), True or False, got 'yes'",
    ),
    ("find-unused-int", dict(find_unused_parameters=1), {}, "construct", r"`find_unused_parameters` must be .*got 1"),
    (
        "zero-backend",
        dict(zero_backend="megatron"),
        {},
        "construct",
        r"`zero_backend` must be one of 'torch', 'deepspeed', got 'megatron'",
    ),
    (
        "zero-backend-deepspeed-tp",
        dict(zero_backend="deepspeed", tensor_parallel_size=2),
        {},
        "construct",
        r"zero_backend='deepspeed' runs data parallelism only; tensor_parallel_size=2",
    ),
    (
        "schedule-unknown",
        dict(pipeline_schedule="ZeroBubble", **PP2),
        {},
        "construct",
        r"`pipeline_schedule` must be one of 'GPipe', '1F1B'.*got 'ZeroBubble'",
    ),
    (
        "schedule-case",
        dict(pipeline_schedule="1f1b", **PP2),
        {},
        "construct",
        r"`pipeline_schedule` must be.*got '1f1b'",
    ),
    (
        "checkpoint-format",
        dict(checkpoint_format="zip"),
        {},
        "construct",
        r"`checkpoint_format` must be one of 'sharded', 'full', got 'zip'",
    ),
    (
        "async-full",
        dict(async_checkpoint=True, checkpoint_format="full"),
        {},
        "construct",
        r"`async_checkpoint=True`.*needs `checkpoint_format='sharded'`, got 'full'",
    ),
    (
        "async-str",
        dict(async_checkpoint="yes"),
        {},
        "construct",
        r"`async_checkpoint` must be True or False, got 'yes'",
    ),
    ("tp-plan-str", dict(tp_plan="magic", **TP2), {}, "construct", r"`tp_plan` must be 'auto', a dict.*got 'magic'"),
    ("tp-plan-none", dict(tp_plan=None, **TP2), {}, "construct", r"`tp_plan` must be 'auto', a dict.*got None"),
    (
        "tp-plan-style",
        dict(tp_plan={"model.*": "diagonal"}, **TP2),
        {},
        "construct",
        r"`tp_plan` has unknown styles \{'model\.\*': 'diagonal'\}; use one of",
    ),
    (
        "tp-plan-int-key",
        dict(tp_plan={1: "colwise"}, **TP2),
        {},
        "construct",
        r"`tp_plan` keys are module-name globs \(str.*got \[1\]",
    ),
    (
        "tp-plan-empty-key",
        dict(tp_plan={"": "colwise"}, **TP2),
        {},
        "construct",
        r"`tp_plan` keys are module-name globs.*got \[''\]",
    ),
    (
        "split-str",
        dict(pipeline_split="middle", **PP2),
        {},
        "construct",
        r"`pipeline_split` must be 'auto' or a list of module names.*got 'middle'",
    ),
    (
        "split-empty",
        dict(pipeline_split=[], **PP2),
        {},
        "construct",
        r"`pipeline_split` must be 'auto' or a list.*got \[\]",
    ),
    (
        "split-not-str",
        dict(pipeline_split=["model.layers.2", 3], **PP2),
        {},
        "construct",
        r"`pipeline_split` must be .*got \['model\.layers\.2', 3\]",
    ),
    (
        "microbatches-0",
        dict(num_microbatches=0, **PP2),
        {},
        "construct",
        r"`num_microbatches` must be a positive integer or None, got 0",
    ),
    (
        "microbatches-float",
        dict(num_microbatches=2.0, **PP2),
        {},
        "construct",
        r"`num_microbatches` must be a positive integer or None, got 2\.0",
    ),
    (
        "microbatches-bool",
        dict(num_microbatches=True, **PP2),
        {},
        "construct",
        r"`num_microbatches` must be a positive integer or None, got True",
    ),
    (
        "stages-per-rank-0",
        dict(stages_per_rank=0, **PP2),
        {},
        "construct",
        r"`stages_per_rank` must be a positive integer or None, got 0",
    ),
    (
        "ac-word",
        dict(activation_checkpointing="some"),
        {},
        "construct",
        r"`activation_checkpointing` must be False, True, 'full', 'selective' or a non-empty list.*got 'some'",
    ),
    ("ac-empty", dict(activation_checkpointing=[]), {}, "construct", r"`activation_checkpointing` must be.*got \[\]"),
    (
        "ac-names",
        dict(activation_checkpointing=["Block"]),
        {},
        "construct",
        r"`activation_checkpointing` must be.*module classes \(e\.g\. \[MyBlock\]\), got \['Block'\]",
    ),
    ("ac-none", dict(activation_checkpointing=None), {}, "construct", r"`activation_checkpointing` must be.*got None"),
    ("cpu-offload-str", dict(cpu_offload="yes"), {}, "construct", r"`cpu_offload` must be True or False, got 'yes'"),
    ("sp-int", dict(sequence_parallel=1, **TP2), {}, "construct", r"`sequence_parallel` must be True or False, got 1"),
    ("lp-str", dict(loss_parallel="yes", **TP2), {}, "construct", r"`loss_parallel` must be True or False, got 'yes'"),
    (
        "cpu-offload-zero0",
        dict(cpu_offload=True),
        {},
        "construct",
        r"`cpu_offload=True`.*needs zero_stage=3, got zero_stage=0\. Set zero_stage=3, or remove cpu_offload",
    ),
    (
        "cpu-offload-zero2",
        dict(cpu_offload=True, zero_stage=2),
        {},
        "construct",
        r"needs zero_stage=3, got zero_stage=2",
    ),
    # --- the rule: an option of a dimension of size 1 is refused, naming the option, the dimension and both fixes
    (
        "sp-without-tp",
        dict(sequence_parallel=True),
        {},
        "construct",
        r"`sequence_parallel=True` .*needs tensor_parallel_size > 1, got 1\. Set tensor_parallel_size > 1, or remove"
        r" `sequence_parallel`",
    ),
    (
        "lp-without-tp",
        dict(loss_parallel=True),
        {},
        "construct",
        r"`loss_parallel=True` .*needs tensor_parallel_size > 1, got 1\. Set .* or remove `loss_parallel`",
    ),
    (
        "tp-plan-without-tp",
        dict(tp_plan={"model.*": "colwise"}),
        {},
        "construct",
        r"`tp_plan=\{'model\.\*': 'colwise'\}` .*needs tensor_parallel_size > 1, got 1.*remove `tp_plan`",
    ),
    (
        "tp-plan-callable-without-tp",
        dict(tp_plan=_noop_plan, tensor_parallel_size=1),
        {},
        "construct",
        r"`tp_plan=<function _noop_plan.*needs tensor_parallel_size > 1, got 1",
    ),
    (
        "microbatches-without-pp",
        dict(num_microbatches=4),
        {},
        "construct",
        r"`num_microbatches=4` .*needs pipeline_parallel_size > 1, got 1\. Set pipeline_parallel_size > 1, or remove"
        r" `num_microbatches`",
    ),
    (
        "schedule-without-pp",
        dict(pipeline_schedule="GPipe"),
        {},
        "construct",
        r"`pipeline_schedule='GPipe'` .*needs pipeline_parallel_size > 1, got 1.*remove `pipeline_schedule`",
    ),
    (
        "interleaved-without-pp",
        dict(pipeline_schedule="Interleaved1F1B", stages_per_rank=2),
        {},
        "construct",
        r"`pipeline_schedule='Interleaved1F1B'` .*needs pipeline_parallel_size > 1, got 1",
    ),
    (
        "stages-per-rank-without-pp",
        dict(stages_per_rank=1),
        {},
        "construct",
        r"`stages_per_rank=1` .*needs pipeline_parallel_size > 1, got 1.*remove `stages_per_rank`",
    ),
    (
        "split-without-pp",
        dict(pipeline_split=["model.layers.2"]),
        {},
        "construct",
        r"`pipeline_split=\['model\.layers\.2'\]` .*needs pipeline_parallel_size > 1, got 1",
    ),
    # --- stages per rank and microbatches against the schedule (torch 2.13's own rules)
    (
        "1f1b-two-stages",
        dict(stages_per_rank=2, **PP2),
        {},
        "construct",
        r"`stages_per_rank=2` needs a multi-stage schedule, but pipeline_schedule='1F1B' runs one stage per rank\."
        r" Choose one of 'Interleaved1F1B'.*or remove stages_per_rank",
    ),
    (
        "gpipe-three-stages",
        dict(pipeline_schedule="GPipe", stages_per_rank=3, **PP2),
        {},
        "construct",
        r"`stages_per_rank=3` needs a multi-stage schedule, but pipeline_schedule='GPipe'",
    ),
    (
        "zbv-three-stages",
        dict(pipeline_schedule="ZBVZeroBubble", stages_per_rank=3, **PP2),
        {},
        "construct",
        r"pipeline_schedule='ZBVZeroBubble' places exactly two stages on each rank \(a V\), got `stages_per_rank=3`\."
        r" Remove stages_per_rank",
    ),
    (
        "dualpipev-one-stage",
        dict(pipeline_schedule="DualPipeV", stages_per_rank=1, **PP2),
        {},
        "construct",
        r"pipeline_schedule='DualPipeV' places exactly two stages.*got `stages_per_rank=1`",
    ),
    (
        "looped-one-stage",
        dict(pipeline_schedule="LoopedBFS", stages_per_rank=1, **PP2),
        {},
        "construct",
        r"pipeline_schedule='LoopedBFS' loops over several stages per rank and needs stages_per_rank >= 2, got"
        r" `stages_per_rank=1`\. Choose 'GPipe' or '1F1B'",
    ),
    (
        "interleaved-one-stage",
        dict(pipeline_schedule="Interleaved1F1B", stages_per_rank=1, **PP2),
        {},
        "construct",
        r"pipeline_schedule='Interleaved1F1B' loops over several stages per rank and needs stages_per_rank >= 2",
    ),
    (
        "1f1b-too-few-microbatches",
        dict(num_microbatches=1, **PP2),
        {},
        "construct",
        r"`num_microbatches=1` cannot run with pipeline_parallel_size=2: 1F1B needs at least as many microbatches as"
        r" stages \(2\), got 1\. Set num_microbatches=2",
    ),
    (
        "1f1b-pp4",
        dict(num_microbatches=3, pipeline_parallel_size=4),
        dict(devices=4),
        "construct",
        r"`num_microbatches=3` cannot run.*stages \(4\), got 3\. Set num_microbatches=4",
    ),
    (
        "dualpipev-microbatches",
        dict(pipeline_schedule="DualPipeV", num_microbatches=3, **PP2),
        {},
        "construct",
        r"DualPipeV needs at least as many microbatches as stages \(4\), got 3\. Set num_microbatches=4",
    ),
    (
        "interleaved-rounds",
        dict(pipeline_schedule="Interleaved1F1B", num_microbatches=5, **PP2),
        {},
        "construct",
        r"`num_microbatches=5` cannot run with pipeline_parallel_size=2: Interleaved1F1B needs a multiple of 2"
        r" microbatches.*got 5\. Set num_microbatches=4",
    ),
    (
        "interleaved-zb-rounds",
        dict(pipeline_schedule="InterleavedZeroBubble", num_microbatches=7, **PP2),
        {},
        "construct",
        r"InterleavedZeroBubble needs a multiple of 3 microbatches.*got 7",
    ),
    # --- how processes start and meet
    (
        "timeout-str",
        dict(timeout="5"),
        {},
        "construct",
        r"`timeout` must be a datetime\.timedelta or a number of seconds, got '5'\. Pass e\.g\. timeout=timedelta",
    ),
    ("timeout-bool", dict(timeout=True), {}, "construct", r"`timeout` must be a datetime\.timedelta.*got True"),
    ("timeout-0", dict(timeout=0), {}, "construct", r"`timeout` must be positive and finite, got 0\. Pass e\.g\."),
    ("timeout-negative", dict(timeout=-1.5), {}, "construct", r"`timeout` must be positive and finite, got -1\.5"),
    (
        "timeout-zero-timedelta",
        dict(timeout=timedelta(0)),
        {},
        "construct",
        r"`timeout` must be positive and finite, got datetime\.timedelta\(0\)",
    ),
    ("timeout-inf", dict(timeout=float("inf")), {}, "construct", r"`timeout` must be positive and finite, got inf"),
    (
        "start-method",
        dict(start_method="thread"),
        {},
        "construct",
        r"`start_method` must be one of 'auto', 'popen', 'fork', 'spawn', 'forkserver', got 'thread'",
    ),
    (
        "backend-unknown",
        dict(process_group_backend="foo"),
        {},
        "construct",
        r"`process_group_backend='foo'`: 'foo' is not a torch\.distributed backend\. Use one of .*'gloo'.*or remove",
    ),
    (
        "backend-per-device-unknown",
        dict(process_group_backend="cpu:foo"),
        {},
        "construct",
        r"`process_group_backend='cpu:foo'`: 'foo' is not a torch\.distributed backend",
    ),
    (
        "backend-empty",
        dict(process_group_backend=""),
        {},
        "construct",
        r"`process_group_backend` must be one of .* or None \(the devices' default\), got ''",
    ),
    ("backend-int", dict(process_group_backend=5), {}, "construct", r"`process_group_backend` must be one of.*got 5"),
    (
        "precision-plugin-64",
        dict(precision_plugin=DoublePrecision()),
        {},
        "construct",
        r"HybridStrategy does not support the precision '64-true'\. Choose one of \('32-true'",
    ),
    # --- when the Trainer is built: world size, resolved "auto" sizes, devices, precision
    (
        "product-below-world",
        dict(data_parallel_size=2),
        dict(devices=4),
        "trainer",
        r"data_parallel_size=2 x tensor_parallel_size=1 x pipeline_parallel_size=1 = 2 processes, but the Trainer has 4"
        r" \(devices x num_nodes\)\. Make the product equal 4, or set `data_parallel_size='auto'`",
    ),
    ("product-above-world", dict(data_parallel_size=4), {}, "trainer", r"= 4 processes, but the Trainer has 2"),
    (
        "tp-does-not-divide",
        dict(tensor_parallel_size=2),
        dict(devices=3),
        "trainer",
        r"The fixed parallel sizes multiply to 2, which does not divide the world size 3.*\[1, 3\]",
    ),
    (
        "tp-pp-too-big",
        dict(tensor_parallel_size=2, pipeline_parallel_size=2),
        {},
        "trainer",
        r"multiply to 4, which does not divide the world size 2",
    ),
    # An "auto" size the world size determines (dp fixed) is checked as resolved; where several layouts are possible
    # the planner chooses at setup among those the options run with, and only none running is refused here.
    (
        "auto-tp-sp",
        dict(tensor_parallel_size="auto", data_parallel_size=2, sequence_parallel=True),
        {},
        "trainer",
        r"`sequence_parallel=True` .*needs tensor_parallel_size > 1, got 1"
        r" \(tensor_parallel_size='auto' resolved to 1\)",
    ),
    (
        "auto-tp-lp",
        dict(tensor_parallel_size="auto", data_parallel_size=2, loss_parallel=True),
        {},
        "trainer",
        r"`loss_parallel=True` .*\(tensor_parallel_size='auto' resolved to 1\)",
    ),
    (
        "auto-pp-microbatches",
        dict(pipeline_parallel_size="auto", data_parallel_size=2, num_microbatches=4),
        {},
        "trainer",
        r"`num_microbatches=4` .*needs pipeline_parallel_size > 1, got 1"
        r" \(pipeline_parallel_size='auto' resolved to 1\)",
    ),
    (
        "auto-pp-schedule",
        dict(pipeline_parallel_size="auto", data_parallel_size=2, pipeline_schedule="GPipe"),
        {},
        "trainer",
        r"`pipeline_schedule='GPipe'` .*\(pipeline_parallel_size='auto' resolved to 1\)",
    ),
    (
        "auto-no-layout-runs",
        dict(tensor_parallel_size="auto", pipeline_parallel_size="auto", sequence_parallel=True, num_microbatches=4),
        {},
        "trainer",
        r"(?s)No layout the 'auto' sizes allow on 2 processes runs with these options:\n- dp=2 x tp=1 x pp=1"
        r" \(zero_stage=0\): `sequence_parallel=True`.*\n- dp=1 x tp=2 x pp=1 \(zero_stage=0\): `num_microbatches=4`",
    ),
    (
        "auto-pp-dualpipev",
        dict(pipeline_parallel_size="auto", data_parallel_size=1, pipeline_schedule="DualPipeV", num_microbatches=2),
        {},
        "trainer",
        r"`num_microbatches=2` cannot run with pipeline_parallel_size=2: DualPipeV needs .* \(4\), got 2",
    ),
    (
        "auto-pp-1f1b",
        dict(pipeline_parallel_size="auto", data_parallel_size=1, num_microbatches=2),
        dict(devices=4),
        "trainer",
        r"`num_microbatches=2` cannot run with pipeline_parallel_size=4: 1F1B needs .*\(4\), got 2",
    ),
    (
        "sync-batchnorm",
        {},
        dict(sync_batchnorm=True),
        "trainer",
        r"HybridStrategy does not implement Trainer\(sync_batchnorm=True\) yet.*Remove sync_batchnorm=True",
    ),
    (
        "precision-64",
        {},
        dict(precision="64"),
        "trainer",
        r"HybridStrategy does not support the precision '64-true'\. Choose one of",
    ),
    ("precision-64-true", {}, dict(precision="64-true"), "trainer", r"does not support the precision '64-true'"),
    ("precision-64-int", {}, dict(precision=64), "trainer", r"does not support the precision '64-true'"),
    # Lightning builds its TransformerEnginePrecision first: without transformer_engine, its own error says so.
    (
        "precision-transformer-engine",
        {},
        dict(precision="transformer-engine"),
        "trainer",
        r"transformer_engine|does not support the precision 'TransformerEnginePrecision'",
    ),
    ("precision-fp8-flag", {}, dict(precision="fp8-mixed"), "trainer", r"Precision 'fp8-mixed' is invalid"),
    (
        "fp8-on-cpu",
        {},
        dict(plugins=[HybridPrecision("fp8-mixed")]),
        "trainer",
        r"HybridPrecision\('fp8-mixed'\) has no float8 matmul kernels on CPU\. Pass `fp8_emulate=True`",
    ),
    (
        "fp8-with-tp",
        TP2,
        dict(plugins=[FP8]),
        "trainer",
        r"HybridPrecision\('fp8-mixed'\) with tensor_parallel_size=2 is not supported yet\. Use 'bf16-mixed'",
    ),
    # --- in the workers' setup: what needs the model
    (
        "heads-not-divisible",
        dict(tensor_parallel_size=2),
        dict(model="llama-1kv"),
        "setup",
        r"tensor_parallel_size=2 must divide every sharded size, but: .*config\.num_key_value_heads = 1",
    ),
    (
        "tp-plan-matches-nothing",
        dict(tensor_parallel_size=2, tp_plan={"model.nope.*": "colwise"}),
        {},
        "setup",
        r"`tp_plan` entry 'model\.nope\.\*' matches no module",
    ),
    (
        "split-unknown-block",
        dict(pipeline_split=["model.model.layers.5"], **PP2),
        {},
        "setup",
        r"`pipeline_split` entry 'model\.model\.layers\.5' is not one of the blocks model\.model\.layers\.0 \.\.\.",
    ),
    (
        "more-stages-than-blocks",
        dict(pipeline_schedule="Interleaved1F1B", stages_per_rank=2, **PP2),
        {},
        "setup",
        r"4 pipeline stages need at least 4 blocks, but 'model\.model\.layers' has 2\. Lower pipeline_parallel_size",
    ),
    (
        "ac-matches-nothing",
        dict(activation_checkpointing=[nn.Conv2d]),
        {},
        "setup",
        r"activation_checkpointing=\[Conv2d\] matches no module of",
    ),
]
IDS = [case[0] for case in CASES]
BEFORE_LAUNCH = [case for case in CASES if case[3] != "setup"]
SETUP = [case for case in CASES if case[3] == "setup"]


def _trainer(strategy, devices=2, **kwargs):
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def test_the_table_is_large_and_its_names_unique():
    assert len(CASES) >= 60 and len(set(IDS)) == len(IDS)


@pytest.mark.parametrize(
    ("name", "strategy_kwargs", "trainer_kwargs", "stage", "match"),
    BEFORE_LAUNCH,
    ids=[case[0] for case in BEFORE_LAUNCH],
)
def test_invalid_configuration_fails_before_launch(name, strategy_kwargs, trainer_kwargs, stage, match):
    if stage == "construct":
        with pytest.raises((ValueError, NotImplementedError), match=match):
            HybridStrategy(**strategy_kwargs)
    else:
        strategy = HybridStrategy(**strategy_kwargs)  # valid on its own: fails only once the Trainer is known
        with pytest.raises((ValueError, NotImplementedError, ModuleNotFoundError), match=match):
            _trainer(strategy, **trainer_kwargs)
    # Raised once, here: no process group, no worker process.
    assert not torch.distributed.is_initialized()
    assert not multiprocessing.active_children()


def _setup_worker(cases):
    env = dict(os.environ)
    messages = []
    for _, strategy_kwargs, extra, _, _ in cases:
        os.environ.update(env)  # Lightning's environment teardown after a failed fit removes WORLD_SIZE
        module = LlamaModule(num_key_value_heads=1) if extra.get("model") == "llama-1kv" else LlamaModule()
        trainer = _trainer(HybridStrategy(**strategy_kwargs), max_steps=1)
        try:
            trainer.fit(module, datamodule=RandomTokenDataModule(num_samples=8, batch_size=4))
            messages.append("no error")
        except Exception as error:  # noqa: BLE001 - the test compares the message
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_what_needs_the_model_fails_in_setup():
    """One 2-process job runs every setup case: each fails on every rank with its own message."""
    results = run_distributed(_setup_worker, 2, SETUP, timeout=120)
    for rank_messages in results:
        for (name, *_, match), message in zip(SETUP, rank_messages):
            assert re.search(match, message), f"{name}: {message}"


def test_valid_neighbours_of_the_refusals_are_accepted():
    """Defaults never trigger a refusal, and the values next to the refused ones are accepted."""
    for kwargs in (
        dict(),
        dict(pipeline_schedule="1F1B", tp_plan="auto", pipeline_split="auto"),  # defaults, given explicitly
        dict(tensor_parallel_size=2, sequence_parallel=True, loss_parallel=True, tp_plan=_noop_plan),
        dict(pipeline_schedule="Interleaved1F1B", num_microbatches=3, stages_per_rank=2, **PP2),
        dict(pipeline_schedule="DualPipeV", stages_per_rank=2, num_microbatches=4, **PP2),
        dict(cpu_offload=True, zero_stage=3, activation_checkpointing=[nn.Linear]),
        dict(timeout=5.5, process_group_backend="cpu:gloo", start_method="spawn"),
        dict(timeout=None),
    ):
        HybridStrategy(**kwargs)
    strategy = HybridStrategy(data_parallel_size=1, tensor_parallel_size="auto", sequence_parallel=True)
    assert _trainer(strategy).strategy.layout.tensor_parallel_size == 2


def test_numbers_of_seconds_become_a_timedelta():
    assert HybridStrategy(timeout=5)._timeout == timedelta(seconds=5)
    assert LaunchOptions(timeout=timedelta(minutes=1)).timeout == timedelta(minutes=1)


def test_backends_missing_from_this_build_or_devices_are_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda name: name == "gloo")
    with pytest.raises(
        ValueError,
        match=r"`process_group_backend='nccl'`: this torch build has no 'nccl' backend\."
        r" Use one of \['gloo'\]",
    ):
        HybridStrategy(process_group_backend="nccl")
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda name: True)
    strategy = HybridStrategy(process_group_backend="nccl")
    with pytest.raises(
        ValueError,
        match=r"`process_group_backend='nccl'` runs collectives on cuda devices only, but"
        r" the Trainer's devices are cpu\. Remove process_group_backend",
    ):
        _trainer(strategy)
    _trainer(HybridStrategy(process_group_backend="cpu:gloo,cuda:nccl"))  # torch's per-device form


def test_tensor_parallel_groups_across_nodes_warn():
    strategy = HybridStrategy(tensor_parallel_size=4, data_parallel_size="auto")
    with pytest.warns(UserWarning, match=r"tensor_parallel_size=4 does not divide the 2 devices of a node"):
        _trainer(strategy, num_nodes=2)


def test_zero_without_data_parallelism_warns_that_nothing_is_sharded():
    with pytest.warns(
        UserWarning,
        match=r"zero_stage=3 shards over data-parallel ranks, but data_parallel_size=1"
        r" \(dp=1 x tp=2 x pp=1 \(zero_stage=3\)\): nothing is sharded",
    ):
        _trainer(HybridStrategy(zero_stage=3, tensor_parallel_size=2))
    with warnings.catch_warnings():  # offloading and casting still use the wrap at dp=1
        warnings.filterwarnings("error", message=".*nothing is sharded")
        _trainer(HybridStrategy(zero_stage=3, tensor_parallel_size=2, cpu_offload=True))
        _trainer(
            HybridStrategy(zero_stage=2, tensor_parallel_size=2),
            plugins=[HybridPrecision("bf16-mixed", param_dtype="bf16")],
        )


def test_schedule_names_are_listed_once():
    from lightning_mgpu.parallel import pipeline

    assert PIPELINE_SCHEDULES == pipeline.SINGLE_STAGE_SCHEDULES + pipeline.LOOP_SCHEDULES + pipeline.V_SCHEDULES
