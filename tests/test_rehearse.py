"""Rehearsal: the library's real setup path at the cluster's world size, on meta tensors and torch's fake group.

Large shapes are rehearsed on a few ranks each (every pipeline stage at tensor-parallel rank 0, where the stages
differ), the command on a small model; the whole 64-rank 70B run of docs/guides/planner.md is the command's own example.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
from typing import Any

import lightning as L
import pytest
import torch

from examples.rehearse.llama import LlamaLM
from examples.rehearse.mixtral import MixtralLM
from lightning_mgpu.cli import main
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.planner.job import Layout, Microbatching, Training
from lightning_mgpu.planner.model_spec import build_on_meta, spec_from_module
from lightning_mgpu.rehearsal import (
    RehearsalError,
    StepBatch,
    beside_the_planner,
    positions,
    predicted_bytes,
    rehearse,
)
from tests.helpers.batched import Run, fit_each, result
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.tiers import case

LLAMA_70B: dict[str, Any] = {}  # the class defaults: Llama-2-70B's shapes
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32}  # fmt: skip
LLAMA_405B = {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
              "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip


def _fp32_bytes(kwargs: dict[str, Any]) -> int:
    return sum(p.numel() * 4 for p in build_on_meta(LlamaLM, kwargs).parameters())


def _planned(layout: ParallelLayout) -> Layout:
    """The planner's candidate for the rehearsed layout (the strategy's default options: what ``rehearse`` runs)."""
    return Layout.from_strategy(layout, ParallelOptions(), Microbatching())


def _stage_ranks(layout: ParallelLayout) -> list[int]:
    """Tensor-parallel rank 0 of every pipeline stage of replica 0."""
    first = positions(replace(layout, expert_parallel_size=1))  # not the other expert-parallel positions
    return [rank for rank in first if rank % layout.tensor_parallel_size == 0]


@pytest.mark.slow  # the slow tier: the rehearsal at scale (hundreds of simulated ranks, or the real 8-process job)
def test_a_70b_llama_at_256_ranks_holds_its_fp32_size_over_the_pipeline_and_tensor_coordinates():
    """tp 8 x pp 8 x dp 4, ZeRO-1: 64 (pp, tp) coordinates to rehearse; every stage's tp rank 0 (and one other tp
    rank: the same bytes) played, their parameters x tp add up to the model's fp32 size within 0.5%; each rank
    beside the planner's prediction for its stage within 2% (optimizer states: the ZeRO-1 owners' mean)."""
    layout = ParallelLayout(4, 8, 8, 1)
    assert len(positions(layout)) == 64
    ranks = [*_stage_ranks(layout), 7]
    reports = rehearse(functools.partial(LlamaLM, **LLAMA_70B), layout, ParallelOptions(), ranks=ranks)
    by_rank = {report.rank: report for report in reports}
    assert by_rank[7].parameter_bytes == by_rank[0].parameter_bytes  # tp ranks hold equal shards
    total = sum(by_rank[rank].parameter_bytes for rank in _stage_ranks(layout)) * 8
    assert total == pytest.approx(_fp32_bytes(LLAMA_70B), rel=5e-3)
    assert [len(by_rank[rank].layers) for rank in _stage_ranks(layout)] == [10] * 8
    model = spec_from_module(build_on_meta(LlamaLM))
    rows = beside_the_planner(reports, predicted_bytes(model, Training(1024), _planned(layout)), 8)
    for row in rows:
        assert abs(row["difference"]["parameter_bytes"]) < 0.02, row
        assert abs(row["difference"]["gradient_bytes"]) < 0.02, row


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_rehearsed_bytes_equal_the_planners_at_64_ranks(zero_stage):
    """A 7B Llama on 64 ranks, tp 4 x pp 4 x dp 4 at each ZeRO stage: parameters and gradients per rank within 2%
    of the planner for its stage; optimizer states within 2% on average over the stages (ZeRO-1 owners hold whole
    tensors, so single ranks differ by up to one tensor)."""
    layout = ParallelLayout(4, 4, 4, zero_stage)
    reports = rehearse(functools.partial(LlamaLM, **LLAMA_7B), layout, ParallelOptions(), ranks=_stage_ranks(layout))
    model = spec_from_module(build_on_meta(LlamaLM, LLAMA_7B))
    rows = beside_the_planner(reports, predicted_bytes(model, Training(1024), _planned(layout)), 4)
    for row in rows:
        assert abs(row["difference"]["parameter_bytes"]) < 0.02, row
        assert abs(row["difference"]["gradient_bytes"]) < 0.02, row
    optimizer = sum(row["optimizer_bytes"] for row in rows) / sum(row["predicted"]["optimizer_bytes"] for row in rows)
    assert optimizer == pytest.approx(1.0, abs=0.02)


@pytest.mark.slow  # the slow tier: the rehearsal at scale (hundreds of simulated ranks, or the real 8-process job)
def test_a_405b_shape_at_1024_ranks_with_16_stages():
    """126 layers over 16 stages, tp 8, dp 8, ZeRO-1: the first, a middle and the last stage played."""
    layout = ParallelLayout(8, 8, 16, 1)
    assert layout.world_size == 1024
    stages = _stage_ranks(layout)
    reports = rehearse(
        functools.partial(LlamaLM, **LLAMA_405B), layout, ParallelOptions(), ranks=[stages[0], stages[7], stages[-1]]
    )
    layers = [len(report.layers) for report in reports]
    assert sum(layers) < 126 and all(7 <= n <= 9 for n in layers), layers
    model = spec_from_module(build_on_meta(LlamaLM, LLAMA_405B))
    rows = beside_the_planner(reports, predicted_bytes(model, Training(1024), _planned(layout)), 16)
    assert abs(rows[1]["difference"]["parameter_bytes"]) < 0.02, rows[1]


def test_the_command_rehearses_and_refuses_the_real_way(capsys):
    """``plan --rehearse --json``: one entry per rank with its axes and bytes; tp 16 with 8 key/value heads exits
    non-zero with the library's own message naming the heads."""
    common = ["plan", "--module", "examples.rehearse.llama:LlamaLM", "--init-args", json.dumps(_SMALL)]
    assert main([*common, "--gpus", "8", "--fix", "tp=2,pp=2,zero=3", "--rehearse", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 8 and len(report["ranks"]) == 4
    for entry in report["ranks"]:
        assert {"rank", "pp", "dp", "tp", "parameter_bytes", "gradient_bytes", "optimizer_bytes"} <= set(entry)
        assert entry["dp"] == 0 and entry["layers"], entry
    assert main([*common, "--gpus", "8", "--fix", "tp=2,pp=2,zero=1", "--rehearse"]) == 0
    assert "every rank: not counted: a pipeline stage's first step exchanges tensor shapes" in capsys.readouterr().out
    assert main([*common, "--gpus", "8", "--fix", "ep=2"]) == 2  # the planner knows ep, and this model has no experts
    assert "expert_parallel_size=2, but LlamaLM has no mixture-of-experts layer" in capsys.readouterr().out
    assert main([*common, "--gpus", "16", "--fix", "tp=16,pp=1,zero=1", "--rehearse"]) == 2
    message = capsys.readouterr().err
    assert re.search(r"config.num_key_value_heads = 8\b.*Valid tensor_parallel_size values.*: \[2, 4, 8\]", message)
    assert message.count("num_key_value_heads") == 1, message  # once, not once per layer


_SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": 512}  # fmt: skip


class StateBytes(L.Callback):
    """What the real job holds per rank before its first optimizer step: parameters, gradients, and (after it)
    optimizer states, counted as the rehearsal counts them."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        from lightning_mgpu.rehearsal.run import _local_bytes, _unique

        parameters = _unique(pl_module.parameters())
        self.results["parameter_bytes"] = sum(_local_bytes(p) for p in parameters)
        self.results["gradient_bytes"] = sum(_local_bytes(p.grad) for p in parameters if p.grad is not None)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_mgpu.rehearsal.run import _state_bytes

        self.results["optimizer_bytes"] = _state_bytes(trainer.optimizers[0])
        self.results["rank"] = trainer.global_rank


@pytest.mark.slow  # the slow tier: the rehearsal at scale (hundreds of simulated ranks, or the real 8-process job)
def test_a_rehearsal_reports_what_the_real_8_process_job_holds():
    """pp 2 x dp 2 x tp 2 at ZeRO-1 and ZeRO-3 on 8 CPU processes: each rank's parameter, gradient and optimizer
    bytes measured in the real job equal the rehearsal's for the same rank."""
    small = functools.partial(LlamaLM, **_SMALL)
    data = functools.partial(RandomTokenDataModule, vocab_size=512, seq_len=16, batch_size=2)
    layouts = {zero: ParallelLayout(2, 2, 2, zero) for zero in (1, 3)}
    runs = {
        zero: Run(small, data, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": zero}, 1,
                  callbacks_factory=lambda: [StateBytes()])
        for zero in layouts
    }  # fmt: skip
    outcomes = fit_each({f"zero {zero}": run for zero, run in runs.items()}, 8, timeout=900)
    for zero, layout in layouts.items():
        _, extras = result(outcomes[f"zero {zero}"])
        measured = {extra["rank"]: extra for extra in extras}
        for report in rehearse(small, layout, ParallelOptions(), ranks=list(range(8))):
            for kind in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
                assert getattr(report, kind) == measured[report.rank][kind], (zero, report.rank, kind)


def test_a_failing_rank_is_reported_with_its_coordinate():
    layout = ParallelLayout(1, 16, 1, 0)
    with pytest.raises(RehearsalError, match=r"rank 0 \{'pp': 0, 'dp': 0, 'tp': 0\}.*key/value heads"):
        rehearse(functools.partial(LlamaLM, **_SMALL), layout, ParallelOptions(), ranks=[0], workers=1)
    assert torch.distributed.is_initialized() is False


MIXTRAL_8X7B: dict[str, Any] = {}  # the class defaults: Mixtral-8x7B's shapes


@pytest.mark.slow  # the slow tier: the rehearsal at scale (hundreds of simulated ranks, or the real 8-process job)
def test_a_mixtral_8x7b_shape_with_expert_parallelism_at_64_ranks():
    """tp 2 x pp 2 x dp 16 with ep 8 at ZeRO-1: every expert-parallel position of the first stage is played (they
    hold different experts: another kind of replica). Each holds 1/8 of its stage's experts, where without expert
    parallelism tensor parallelism splits them in 2: the difference is exactly that."""
    layout = ParallelLayout(16, 2, 2, 1, expert_parallel_size=8)
    ranks = positions(layout)
    assert len(ranks) == 4 + 7  # the (pp, tp) coordinates of replica 0, then dp 1..7 of the first stage
    build = functools.partial(MixtralLM, **MIXTRAL_8X7B)
    reports = rehearse(build, layout, ParallelOptions(), ranks=[0, 32, *ranks[4:]])
    first_stage = [r for r in reports if r.coordinate["pp"] == 0]
    assert len(first_stage) == 8 and len({r.parameter_bytes for r in first_stage}) == 1
    assert [len(r.layers) for r in reports if r.rank in (0, 32)] == [16, 16]
    (without,) = rehearse(build, replace(layout, expert_parallel_size=1), ParallelOptions(), ranks=[0])
    whole = build_on_meta(MixtralLM, MIXTRAL_8X7B)
    experts = sum(p.numel() * 4 for n, p in whole.named_parameters() if ".experts." in n and ".layers.0." in n)
    expected = 16 * experts * (1 / 2 - 1 / 8)
    assert without.parameter_bytes - first_stage[0].parameter_bytes == pytest.approx(expected, rel=1e-3)


def _expert_case(pp: int, zero_stage: int, ep: int):
    """The quick tier: one case of each way the experts are held (replicated at ZeRO 0-1 under a pipeline, sharded
    over their dp / ep replicas, split by tp at ep 1); the slow tier the other stages and sizes."""
    quick = (pp, zero_stage, ep) in {(2, 1, 8), (1, 3, 8), (1, 3, 1)}
    return case(pp, zero_stage, ep, slow=not quick)


@pytest.mark.parametrize(
    ("pp", "zero_stage", "ep"),
    [_expert_case(*case) for case in [(1, 0, 8), (1, 1, 8), (1, 2, 4), (1, 3, 8), (2, 1, 8), (2, 3, 4), (1, 3, 1)]],
)
def test_rehearsed_expert_parallel_bytes_equal_the_planners_at_64_ranks(pp, zero_stage, ep):
    """Mixtral-8x7B on 64 ranks at tp 2: each stage's first rank (replica 0, the fullest) within 2% of the planner for
    parameters and gradients, optimizer states on average over the stages. The planner follows the real wraps: the
    experts split over ep, sharded evenly over their dp / ep replicas (within each expert: a fused [experts, ...]
    weight's first dimension would leave Mixtral's 1 expert per rank whole on one replica), replicated at ZeRO 0-1
    under a pipeline; at ep 1 they are split by tensor parallelism and sharded with the rest, by whole experts."""
    layout = ParallelLayout(64 // (2 * pp), 2, pp, zero_stage, expert_parallel_size=ep)
    reports = rehearse(
        functools.partial(MixtralLM, **MIXTRAL_8X7B), layout, ParallelOptions(), ranks=_stage_ranks(layout)
    )
    model = spec_from_module(build_on_meta(MixtralLM, MIXTRAL_8X7B))
    assert (model.experts, model.experts_per_token, model.fused_experts) == (8, 2, True)
    rows = beside_the_planner(reports, predicted_bytes(model, Training(1024), _planned(layout)), pp)
    for row in rows:
        assert abs(row["difference"]["parameter_bytes"]) < 0.02, row
        assert abs(row["difference"]["gradient_bytes"]) < 0.02, row
    optimizer = sum(row["optimizer_bytes"] for row in rows) / sum(row["predicted"]["optimizer_bytes"] for row in rows)
    assert optimizer == pytest.approx(1.0, abs=0.02)


def _stepped(layout: ParallelLayout, options: ParallelOptions | None = None) -> list:
    build = functools.partial(LlamaLM, **_SMALL)
    return rehearse(build, layout, options or ParallelOptions(), step_batch=StepBatch(2, 64, _SMALL["vocab_size"]))


def test_one_rehearsed_step_counts_the_collectives_of_each_axis():
    """One training step per rank under FakeTensorMode: the collectives per mesh axis are the analytic ones.

    - tp (Megatron): per block, an all-reduce after attention and after the MLP forward and one for each of their
      inputs' gradients backward; plus the vocabulary-parallel embedding's forward all-reduce and the head input's
      gradient;
    - ZeRO-3 (FSDP2, a unit per block and one for the rest): every unit gathered forward, the blocks again backward,
      each unit's gradients reduce-scattered once: the scattered bytes are this tp rank's fp32 parameters (its
      ZeRO shard x dp);
    - DDP (ZeRO-0): the buckets' all-reduces carry every fp32 gradient once (and a few scalars: the first step's
      unused-parameter decision);
    - pipeline stages: not stepped, said so.
    """
    layers = _SMALL["num_hidden_layers"]
    (sharded, _) = _stepped(ParallelLayout(2, 2, 1, 3))
    counted = sharded.collectives
    assert counted is not None, sharded.collectives_note
    assert counted["tp"]["all_reduce"]["calls"] == 4 * layers + 2, counted
    assert counted["dp"]["allgather_base"]["calls"] == 2 * layers + 1, counted
    assert counted["dp"]["reduce_scatter_base"]["calls"] == layers + 1, counted
    assert counted["dp"]["reduce_scatter_base"]["bytes"] == 2 * sharded.parameter_bytes, counted

    (replicated,) = _stepped(ParallelLayout(8, 1, 1, 0))
    buckets = replicated.collectives["dp"]["allreduce"]  # type: ignore[index]
    assert 0 <= buckets["bytes"] - replicated.parameter_bytes < 1024, (buckets, replicated.parameter_bytes)

    staged = _stepped(ParallelLayout(2, 1, 2, 1))
    assert all(r.collectives is None and "pipeline stage" in r.collectives_note for r in staged), staged


def _sparse_hugging_face_checkpoint(directory, kwargs: dict[str, Any], files: int = 30, wrong: str = "") -> int:
    """A Llama checkpoint in bf16 as ``save_pretrained`` lays it out (shards and their index), written as headers
    and holes: its files take no disk space, only a reader of their data would notice. Returns its tensor bytes.
    ``wrong``: one entry saved one row longer than the model's."""
    from lightning_mgpu.checkpoint.stream import Leaf

    shapes = {k: tuple(v.shape) for k, v in build_on_meta(LlamaLM, kwargs).model.state_dict().items()}
    names = sorted(shapes)
    per_file = -(-len(names) // files)
    weight_map, total = {}, 0
    for index in range(files):
        chunk = names[index * per_file : (index + 1) * per_file]
        if not chunk:
            continue
        file = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        header, offset = {}, 0
        for name in chunk:
            shape = list(shapes[name])
            if name == wrong:
                shape[0] += 1
            leaf = Leaf(name, tuple(shape), torch.bfloat16)
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + leaf.nbytes]}
            offset += leaf.nbytes
            weight_map[name] = file
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / file, "wb") as out:
            out.write(len(encoded).to_bytes(8, "little") + encoded)
            out.truncate(8 + len(encoded) + offset)  # a hole: nothing written
        total += offset
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def test_the_load_of_a_140_gb_checkpoint_is_rehearsed_from_its_headers(tmp_path):
    """Llama-2-70B's pretrained weights (bf16, 30 sparse shards) at tp 8 x pp 8, ZeRO-1, on 64 ranks: every entry
    maps onto the module, and each rank reads exactly its slices (half its fp32 parameter bytes, in bf16); a
    checkpoint with one wrong shape is refused as the strategy refuses it, naming the entry."""
    from lightning_mgpu.checkpoint.pretrained import open_weights
    from lightning_mgpu.rehearsal import Pretrained

    total = _sparse_hugging_face_checkpoint(tmp_path, LLAMA_70B)
    assert total > 130 * 10**9
    layout = ParallelLayout(1, 8, 8, 1)
    ranks = [0, 7, 63]  # the first stage (embedding) at two tp ranks, the last stage (head)
    weights = Pretrained(open_weights(tmp_path))
    reports = rehearse(
        functools.partial(LlamaLM, **LLAMA_70B), layout, ParallelOptions(), ranks=ranks, pretrained=weights
    )
    for report in reports:
        assert report.read_bytes == report.parameter_bytes // 2, report
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    _sparse_hugging_face_checkpoint(wrong, LLAMA_70B, wrong="model.layers.3.mlp.down_proj.weight")
    with pytest.raises(RehearsalError, match=r"shapes differ: model\.model\.layers\.3\.mlp\.down_proj\.weight is"):
        rehearse(
            functools.partial(LlamaLM, **LLAMA_70B),
            layout,
            ParallelOptions(),
            ranks=[0],
            workers=1,
            pretrained=Pretrained(open_weights(wrong)),
        )
