"""Hybrid sharding (HSDP): ZeRO over groups of ``data_parallel_shard_size`` consecutive data-parallel ranks,
replicated across the groups, trains like one process and checkpoints to and from any layout."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_mgpu import HybridStrategy
from lightning_mgpu.layout import DP_AXIS, DP_REPLICATE_AXIS, DP_SHARD_AXIS
from tests.helpers import public_models as pm
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule

STEPS = 10
GLOBAL_BATCH = 8
WEIGHT_ATOL = 1e-4  # AdamW turns reduction-order noise on near-zero gradients into ~1e-5 steps
MODELS = {
    "nanoGPT": functools.partial(NanoGPTModule, n_layer=2),
    "HF Llama": functools.partial(pm.HFCausalLM, "llama", dropout=0.0),
}
LAYOUTS: dict[str, dict[str, Any]] = {  # on 4 ranks
    "dp 4 HSDP(2) ZeRO-1": {"zero_stage": 1, "data_parallel_shard_size": 2},
    "dp 4 HSDP(2) ZeRO-2": {"zero_stage": 2, "data_parallel_shard_size": 2},
    "dp 4 HSDP(2) ZeRO-3": {"zero_stage": 3, "data_parallel_shard_size": 2},
    "pp 2 x dp 2 HSDP(1) ZeRO-3": {"pipeline_parallel_size": 2, "zero_stage": 3, "data_parallel_shard_size": 1},
}


def _data(batch: int) -> Any:
    return functools.partial(RandomTokenDataModule, vocab_size=pm.VOCAB, seq_len=pm.SEQUENCE, batch_size=batch)


def _dp(strategy: dict[str, Any]) -> int:
    return 4 // strategy.get("pipeline_parallel_size", 1)


class ShardGroups(L.Callback):
    """Each rank's shard group, data-parallel group and the placements of its sharded parameters."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mesh = trainer.strategy.device_mesh  # type: ignore[attr-defined]
        self.results["shard_group"] = dist.get_process_group_ranks(mesh[DP_SHARD_AXIS].get_group())
        self.results["dp_group"] = dist.get_process_group_ranks(mesh[DP_AXIS].get_group())
        self.results["placements"] = {
            str(p.placements) for p in pl_module.parameters() if isinstance(p, DTensor) and p.device_mesh.ndim == 2
        }

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        names = {p: n for n, p in pl_module.named_parameters()}
        state = trainer.optimizers[0].state
        self.results["stepped"] = sorted(names[p] for p in state if p in names and state[p])
        self.results["all"] = sorted(names.values())


class GroupTraffic(L.Callback):
    """Ring bytes this rank sends per training batch through ``torch.distributed``'s Python collectives (FSDP2's,
    and the gloo comms' all-to-all and broadcasts), by group: the shard group, the replicate group, all of dp.
    Ops of one element (logging syncs) are left out. Observes only: every call goes to the original function."""

    NAMES = ("all_reduce", "all_to_all_single", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.results: dict[str, Any] = {"per_batch": []}
        self._originals: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        mesh = trainer.strategy.device_mesh  # type: ignore[attr-defined]
        groups = {
            "shard": tuple(dist.get_process_group_ranks(mesh[DP_SHARD_AXIS].get_group())),
            "replicas": tuple(dist.get_process_group_ranks(mesh[DP_REPLICATE_AXIS].get_group())),
            "dp": tuple(dist.get_process_group_ranks(mesh[DP_AXIS].get_group())),
        }
        sent = dict.fromkeys(groups, 0.0)
        self.results["per_batch"].append(sent)
        for name in self.NAMES:
            original = self._originals[name] = getattr(dist, name)
            setattr(dist, name, functools.partial(self._count, original, name, groups, sent))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    @staticmethod
    def _count(original: Any, name: str, groups: dict, sent: dict, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        kind = next((k for k, members in groups.items() if members == ranks), None)
        tensor = args[1] if name in ("all_to_all_single", "all_gather_into_tensor") else args[0]
        w = len(ranks)
        if kind is not None and tensor.numel() > 1 and w > 1:
            # all-reduce: 2(w-1)/w of the tensor; all-to-all: (w-1)/w of its input; a broadcast: this rank sends
            # its own chunk to w-1 peers, (w-1)/w of the gathered whole over the w broadcasts of one gather.
            factor = {"all_reduce": 2 * (w - 1) / w}.get(name, (w - 1) / w)
            nbytes = tensor.numel() * tensor.element_size()
            if name == "all_gather_into_tensor":
                nbytes *= w
            sent[kind] += factor * nbytes
        return original(*args, **kwargs)


_outcomes: dict[str, Any] = {}


def _trained() -> dict[str, Any]:
    """Every model under every layout, in one 4-rank job."""
    if not _outcomes:
        runs = {
            f"{model} {layout}": Run(
                factory, _data(GLOBAL_BATCH // _dp(kwargs)), kwargs, STEPS, callbacks_factory=_probes(model, layout)
            )
            for model, factory in MODELS.items()
            for layout, kwargs in LAYOUTS.items()
        }
        _outcomes.update(fit_each(runs, 4, timeout=900))
    return _outcomes


_COUNTED = ("dp 4 HSDP(2) ZeRO-2", "dp 4 HSDP(2) ZeRO-3")


def _probes(model: str, layout: str) -> Any:
    if model == "nanoGPT" and layout in _COUNTED:
        return lambda: [ShardGroups(), GroupTraffic()]
    return lambda: [ShardGroups()]


@pytest.mark.parametrize("layout", _COUNTED)
def test_hybrid_sharding_traffic_splits_as_the_analytic_formula_says(layout):
    """Per step: gradients reduce-scattered and parameters gathered in the shard group ((k-1)/k of them each), the
    gradient shards all-reduced across replicas (2(r-1)/r of 1/k of them), nothing over all of dp."""
    from lightning_mgpu.planner.cost import data_parallel_bytes

    _, extras = result(_trained()[f"nanoGPT {layout}"])
    model = MODELS["nanoGPT"]().model
    numel = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.transformer.h.parameters())
    zero = LAYOUTS[layout]["zero_stage"]
    gathered = 2 * blocks + (numel - blocks) if zero == 3 else numel  # ZeRO-3: blocks again in backward
    expected = data_parallel_bytes(numel, zero, dp=4, shard=2, gathered=gathered)
    assert expected["shard"] > 0 and expected["replicas"] > 0 and expected["dp"] == 0
    for extra in extras:
        for counted in extra["per_batch"][1:]:  # the first step builds lazily what later steps reuse
            assert counted == pytest.approx(expected, rel=1e-6), (layout, counted, expected)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_hybrid_sharding_trains_like_one_process(model, layout):
    (reference,) = references({model: Run(MODELS[model], _data(GLOBAL_BATCH), None, STEPS)}).values()
    trained, extras = result(_trained()[f"{model} {layout}"])
    assert_same_training(result(reference), trained, weight_atol=WEIGHT_ATOL)
    shard = LAYOUTS[layout]["data_parallel_shard_size"]
    dp = _dp(LAYOUTS[layout])
    for rank, extra in enumerate(extras):
        # Shard groups are consecutive data-parallel ranks (a node); dp is still every replica.
        assert len(extra["shard_group"]) == shard, extra
        assert len(extra["dp_group"]) == dp, extra
        assert extra["shard_group"] == sorted(extra["shard_group"]), extra
        assert extra["shard_group"][-1] - extra["shard_group"][0] == (shard - 1) * (4 // dp), extra
        if LAYOUTS[layout]["zero_stage"] >= 2:  # fully_shard on the (dp_replicate, dp_shard) mesh
            assert extra["placements"] == {"(Replicate(), Shard(dim=0))"}, (rank, extra["placements"])
    if LAYOUTS[layout]["zero_stage"] == 1 and shard > 1:
        # ZeRO-1: the ranks of a shard group own disjoint parts of the optimizer state that together cover every
        # parameter, and each replica splits it the same way.
        group = [extras[rank]["stepped"] for rank in extras[0]["shard_group"]]
        assert sorted(name for part in group for name in part) == extras[0]["all"], group
        replica = [extras[rank]["stepped"] for rank in extras[-1]["shard_group"]]
        assert replica == group


def test_a_hybrid_sharded_checkpoint_resumes_under_pipeline_and_tensor_parallelism(tmp_path):
    """Saved at step 3 of 6 under dp 4 HSDP(2) ZeRO-3, resumed under pp 2 x tp 2: the resumed steps' losses as the
    uninterrupted run's, and the states loaded equal to those saved."""
    from tests.test_checkpoint import CROSS_LAYOUT_RTOL, SaveAt, _assert_same_states, _losses_match

    factory = MODELS["HF Llama"]
    saved, _ = fit(
        factory, _data(GLOBAL_BATCH // 4), LAYOUTS["dp 4 HSDP(2) ZeRO-3"], 4, STEPS,
        callbacks_factory=lambda: [SaveAt(tmp_path, (3,))],
    )  # fmt: skip
    resaved = tmp_path / "pp2xtp2"
    resaved.mkdir()
    resumed, _ = fit(
        factory, _data(GLOBAL_BATCH), {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, STEPS,
        callbacks_factory=lambda: [SaveAt(resaved, resave=True)],
        fit_kwargs={"ckpt_path": str(tmp_path / "step3.ckpt")},
    )  # fmt: skip
    _losses_match(saved.losses, resumed.losses, 3, CROSS_LAYOUT_RTOL)
    _assert_same_states(tmp_path / "step3.ckpt", resaved / "resaved.ckpt")


REFUSED = {
    "does not divide": ({"data_parallel_size": 4, "data_parallel_shard_size": 3, "zero_stage": 3}, ValueError,
                        r"data_parallel_shard_size=3 must divide data_parallel_size=4.*\[1, 2, 4\]"),
    "zero 0": ({"data_parallel_size": 4, "data_parallel_shard_size": 2}, ValueError,
               r"zero_stage=0 shards nothing. Set zero_stage to 1, 2 or 3"),
    "deepspeed": ({"data_parallel_shard_size": 2, "zero_stage": 2, "zero_backend": "deepspeed"},
                  NotImplementedError, r"does not compose with zero_backend='deepspeed'"),
    "not a size": ({"data_parallel_shard_size": 0}, ValueError, r"`data_parallel_shard_size` must be a positive"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_hybrid_sharding_refusals_name_the_value_and_the_fix(case):
    kwargs, error, message = REFUSED[case]
    with pytest.raises(error, match=message):
        L.Trainer(accelerator="cpu", devices=4, strategy=HybridStrategy(**kwargs), logger=False)
