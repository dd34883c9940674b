"""Data parallelism and ZeRO 0-3: same losses and weights as one process, ZeRO memory formulas, no wasted comms."""

from __future__ import annotations

import pytest
import torch

from lightning_mgpu.demo import GPTLightningModule, TextDataModule
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import CNNModule, LlamaModule, RandomImageDataModule, RandomTokenDataModule
from tests.helpers.probes import CollectiveCounter, MemoryProbe
from tests.helpers.tiers import case

GLOBAL_BATCH = 8
STEPS = 10


def _gpt():
    return GPTLightningModule(block_size=32, n_layer=2, n_head=4, n_embd=32, weight_decay=0.1, lr=1e-3)


MODELS = {
    "gpt": (_gpt, lambda batch: TextDataModule(batch_size=batch, block_size=32)),
    "llama": (LlamaModule, lambda batch: RandomTokenDataModule(batch_size=batch)),
    "cnn": (CNNModule, lambda batch: RandomImageDataModule(batch_size=batch)),
}

_references: dict = {}


def reference(model: str, trainer_kwargs: dict | None = None):
    key = (model, tuple(sorted((trainer_kwargs or {}).items())))
    if key not in _references:
        module, data = MODELS[model]
        _references[key], _ = fit(module, lambda: data(GLOBAL_BATCH), None, 1, STEPS, trainer_kwargs=trainer_kwargs)
    return _references[key]


# The probes the ZeRO memory and communication tests read, attached to the matrix's own GPT fits (probes only
# observe: the losses and weights the matrix compares are the same with them).
# Steps profiled. DDP (stages 0-1) searches for unused parameters in step 1, finds none and is rebuilt without the
# search; the new reducer rebuilds its buckets after its first step (a broadcast in step 3); steps 4-5 are steady.
COUNTED = 5
_PROBES = {("gpt", 4): lambda: [MemoryProbe(step=1)], ("gpt", 2): lambda: [CollectiveCounter(batches=COUNTED)]}
_runs: dict = {}


def _layout_run(model: str, dp: int, zero_stage: int):
    """One fit per layout of the matrix, read by every test that checks something of that layout."""
    key = (model, dp, zero_stage)
    if key not in _runs:
        module, data = MODELS[model]
        _runs[key] = fit(
            module,
            lambda: data(GLOBAL_BATCH // dp),
            {"zero_stage": zero_stage},
            dp,
            STEPS,
            callbacks_factory=_PROBES.get((model, dp)),
        )
    return _runs[key]


def _matrix_case(model: str, dp: int, zero_stage: int):
    """The quick tier trains the GPT under every stage at both sizes (the memory and traffic tests read those fits)
    and the other models once, at dp 4 under ZeRO-3; the slow tier their other 14 layouts."""
    quick = model == "gpt" or (dp, zero_stage) == (4, 3)
    return case(model, dp, zero_stage, id=f"{model}-{dp}-{zero_stage}", slow=not quick)


@pytest.mark.parametrize(
    ("model", "dp", "zero_stage"),
    [_matrix_case(model, dp, zero_stage) for model in sorted(MODELS) for dp in (2, 4) for zero_stage in (0, 1, 2, 3)],
)
def test_zero_stage_trains_like_one_process(model, dp, zero_stage):
    result, _ = _layout_run(model, dp, zero_stage)
    assert_same_training(reference(model), result)


# What each rank holds right after backward with fp32 AdamW, per parameter: params 4 B, grads 4 B, moments 8 B;
# "shard" means divided over the data-parallel ranks. FSDP2 reshards parameters after backward, so stage 2 holds
# 4/dp parameter bytes at that point, the "or less" of the ZeRO-2 formula 4 + 12/dp.
ZERO_LAYOUT = {
    0: {"param_bytes": "full", "grad_bytes": "full", "optim_bytes": "full"},  # 16 B
    1: {"param_bytes": "full", "grad_bytes": "full", "optim_bytes": "owned"},  # 8 + 8/dp B
    2: {"param_bytes": "shard", "grad_bytes": "shard", "optim_bytes": "shard"},  # 16/dp B
    3: {"param_bytes": "shard", "grad_bytes": "shard", "optim_bytes": "shard"},  # 16/dp B
}
FULL_BYTES = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8}
SHARD_IMBALANCE = 0.05  # FSDP2 cuts dim 0 in dp chunks; uneven rows leave ranks a few percent apart


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_memory_per_rank_follows_zero_formulas(zero_stage):
    dp = 4
    _, extras = _layout_run("gpt", dp, zero_stage)  # measured at step 1 of the matrix's fit
    numel, largest = extras[0]["numel"], extras[0]["largest_numel"]
    for kind, how in ZERO_LAYOUT[zero_stage].items():
        full = FULL_BYTES[kind] * numel
        per_rank = [e[kind] for e in extras]
        if how == "full":
            assert per_rank == [full] * dp, (kind, per_rank, full)
            continue
        assert sum(per_rank) == full, (kind, per_rank, full)  # every byte held exactly once
        for measured in per_rank:
            if how == "shard":
                assert measured == pytest.approx(full / dp, rel=SHARD_IMBALANCE), (kind, per_rank)
            else:  # whole tensors per owner, balanced greedily: off by at most the largest tensor
                assert abs(measured - full / dp) <= FULL_BYTES[kind] * largest, (kind, per_rank)
    held = sum(extras[0][k] for k in FULL_BYTES) / numel
    print(f"zero_stage={zero_stage} dp={dp}: rank 0 holds {held:.2f} bytes/param after backward")


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_gradient_accumulation_communicates_only_on_the_final_micro_step(zero_stage):
    dp, accumulate = 2, 2
    trainer_kwargs = {"accumulate_grad_batches": accumulate}
    result, extras = fit(
        MODELS["llama"][0],
        lambda: RandomTokenDataModule(batch_size=GLOBAL_BATCH // dp),
        {"zero_stage": zero_stage},
        dp,
        STEPS,
        trainer_kwargs=trainer_kwargs,
        # Three optimizer steps profiled (the first, DDP's rebuilt reducer in the second, a steady one): profiling
        # every micro-step cost more than the fit.
        callbacks_factory=lambda: [CollectiveCounter(batches=3 * accumulate)],
    )
    assert_same_training(reference("llama", trainer_kwargs), result)
    per_batch = extras[0]["per_batch"]
    assert len(per_batch) == 3 * accumulate, per_batch
    # ZeRO-2/3 reduce-scatter with an all-to-all on gloo (lightning_mgpu.parallel.data.gloo_comms).
    reductions = [sum(b.get(kind, 0) for kind in ("AR", "RS", "RD", "A2A")) for b in per_batch]
    assert all(r == 0 for r in reductions[0::accumulate]), reductions
    assert all(r > 0 for r in reductions[accumulate - 1 :: accumulate]), reductions


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_gradient_clipping_uses_the_global_norm(zero_stage):
    dp = 2
    trainer_kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    module, data = MODELS["gpt"]
    result, _ = fit(
        module, lambda: data(GLOBAL_BATCH // dp), {"zero_stage": zero_stage}, dp, STEPS, trainer_kwargs=trainer_kwargs
    )
    clipped_reference = reference("gpt", trainer_kwargs)
    assert clipped_reference.losses != reference("gpt").losses  # the clip is active
    assert_same_training(clipped_reference, result)


def _analytic_bytes_per_step(zero_stage: int, dp: int, numel: int, block_numel: int) -> float:
    """The fewest bytes a rank sends per step (fp32, ring collectives): all-reduce of gradients for stage 0;
    reduce-scatter of gradients + all-gather of parameters for stages 1 and 2 (the same volume); stage 3 gathers
    the blocks a second time in backward (the root, called once per step, stays gathered)."""
    f = (dp - 1) / dp
    return 2 * f * 4 * numel + (f * 4 * block_numel if zero_stage == 3 else 0)


@pytest.mark.parametrize(
    ("zero_stage", "gathers"), [(0, None), (1, None), (2, lambda blocks: 1), (3, lambda blocks: 2 * blocks + 1)]
)
def test_communication_per_step_is_the_analytic_minimum(zero_stage, gathers):
    """Counted from the collectives issued (profiler, C++ DDP included): ZeRO-1/2 move 2(dp-1)/dp x 4N bytes.

    Stage 2 gathers the whole model once per step (one unit: it stays gathered through backward anyway); stage 3
    gathers each block in forward and again in backward, the root (embeddings, head) once, although the step
    calls `self(x)` inside the root's forward."""
    dp = 2
    _, extras = _layout_run("gpt", dp, zero_stage)  # counted in the first steps of the matrix's fit
    gpt = MODELS["gpt"][0]().model
    numel = sum(p.numel() for p in gpt.parameters())
    blocks = gpt.transformer.h
    expected = _analytic_bytes_per_step(zero_stage, dp, numel, sum(p.numel() for p in blocks.parameters()))
    searched = 2 * (dp - 1) / dp * 4 * len(list(gpt.parameters()))  # DDP's map of used parameters: an int32 each
    for rank in extras:
        counted = rank["bytes_per_batch"]
        assert counted[3:] == [expected] * (COUNTED - 3), (zero_stage, counted, expected, rank["per_batch"])
        if zero_stage <= 1:  # the first step searched for unused parameters (one more all-reduce), the rest not
            assert counted[0] - counted[3] >= searched, (counted, searched)
            all_reduces = [b.get("AR", 0) for b in rank["per_batch"]]
            assert all_reduces[0] == all_reduces[3] + 1 and all_reduces[3:] == [all_reduces[3]] * 2, all_reduces
    if gathers is not None:
        # On gloo every rank broadcasts its shard into place (lightning_mgpu.parallel.data.gloo_comms): dp per gather.
        per_batch = [b.get("BC", 0) for b in extras[0]["per_batch"]]
        assert per_batch == [dp * gathers(len(blocks))] * COUNTED, per_batch


class _GPTWithUnusedLayer(GPTLightningModule):
    """A step that leaves some parameters without a gradient (an unused layer, like a head trained elsewhere)."""

    def __init__(self):
        super().__init__(block_size=32, n_layer=2, n_head=4, n_embd=32, weight_decay=0.1, lr=1e-3)
        self.unused = torch.nn.Linear(32, 32)


_unused_single: list = []


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_parameters_without_gradients_train_like_one_process(zero_stage):
    dp = 2
    data = MODELS["gpt"][1]
    if not _unused_single:  # one process, no wrapper: the same run for every stage
        _unused_single.append(fit(_GPTWithUnusedLayer, lambda: data(GLOBAL_BATCH), {}, 1, 4)[0])
    single = _unused_single[0]
    result, _ = fit(_GPTWithUnusedLayer, lambda: data(GLOBAL_BATCH // dp), {"zero_stage": zero_stage}, dp, 4)
    assert_same_training(single, result)


def test_zero1_owners_hold_consecutive_runs_of_about_equal_size():
    """Each rank owns one run of consecutive parameters, its share give or take the largest tensor, so that a DDP
    bucket (the parameters in reverse order) holds one segment per owner: reduced in place, without copies."""
    from lightning_mgpu.parallel.data.wrap import _balance, _owner_spans

    params = [torch.empty(n) for n in (7, 300, 5, 120, 64, 64, 1, 250, 3)]
    total, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    for dp in (2, 3, 4):
        owner = _balance(params, dp)
        ranks = [owner[p] for p in params]
        assert ranks == sorted(ranks), (dp, ranks)
        for rank in range(dp):
            held = sum(p.numel() for p in params if owner[p] == rank)
            assert abs(held - total / dp) <= largest, (dp, rank, held)
        spans = _owner_spans(params[::-1], owner)
        assert sorted(spans) == sorted(set(ranks)) and all(len(runs) == 1 for runs in spans.values()), spans
        assert sum(end - start for runs in spans.values() for start, end in runs) == total


def test_collective_counter_pairs_each_op_with_a_work_item_of_its_kind():
    """gloo starts work items on two worker threads: async ops issued back to back may start swapped (here DDP's
    unused-parameter all-reduce before the hook's second reduce), which must change neither counts nor bytes."""
    from types import SimpleNamespace

    from tests.helpers.probes import collectives_of

    def event(name, start, shapes=()):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start), input_shapes=list(shapes))

    ops = [("reduce_", []), ("reduce_", []), ("allreduce_", []), ("_reduce_scatter_base_", [[29], [58]])]
    in_order = [[[20992]], [[21888]], [[29]], [[58]]]
    expected = collectives_of(
        SimpleNamespace(
            events=lambda: (
                [event(f"c10d::{n}", i, s) for i, (n, s) in enumerate(ops)]
                + [event("gloo:" + ("reduce" if i < 2 else "all_reduce"), 10 + i, s) for i, s in enumerate(in_order)]
            )
        ),
        2,
    )
    assert expected == {
        "counts": {"RD": 2, "AR": 1, "RS": 1},
        "small": {},
        "bytes": 2 * (20992 + 21888) + 116 + 116,
        "bytes_by_kind": {"RD": 2 * (20992 + 21888), "AR": 116, "RS": 116},
    }
    started = [("all_reduce", [[58]]), ("all_reduce", [[29]]), ("reduce", [[21888]]), ("reduce", [[20992]])]
    swapped = SimpleNamespace(
        events=lambda: (
            [event(f"c10d::{n}", i, s) for i, (n, s) in enumerate(ops)]
            + [event(f"gloo:{n}", 10 + i, s) for i, (n, s) in enumerate(started)]
        )
    )
    assert collectives_of(swapped, 2) == expected
