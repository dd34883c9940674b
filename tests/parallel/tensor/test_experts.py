"""Mixture-of-experts under tensor parallelism with the models' own Hugging Face plans (``tensor/experts.py``).

Mixtral and Qwen3-MoE as shipped (tiny configurations, random weights), trained with Hugging Face's own loss and
``output_router_logits=True`` (the load-balancing loss is part of the loss): tp=2 with ``tp_plan="auto"`` trains like
one process, each rank holds half of every expert weight, and the tp=2 checkpoint loads strictly into one process.
Mixtral also under dp2 x tp2 with ZeRO-1 and ZeRO-3, and with sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_mgpu.parallel.tensor.experts import ExpertsParallel, place_experts
from lightning_mgpu.parallel.tensor.plan import _match, auto_plan
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.equivalence import assert_same_training
from tests.parallel.tensor.test_hf_styles import GLOBAL_BATCH, TP_WEIGHT_ATOL, HFModule, _tokens

transformers = pytest.importorskip("transformers")

EXPERTS = ("gate_up_proj", "down_proj")


class MoEModule(HFModule):
    """A Hugging Face MoE causal LM trained on its own loss, router load-balancing loss included by default."""

    def __init__(self, config_name: str, model_name: str, output_router_logits: bool = True, **overrides: Any) -> None:
        super().__init__(config_name, model_name, output_router_logits=output_router_logits, **overrides)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        out = self.model(input_ids=x, labels=x)
        self.log("train_loss", out.loss, sync_dist=True)
        return out.loss


def mixtral(**kw: Any) -> MoEModule:
    return MoEModule("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, **kw)


def mixtral_without_aux_loss() -> MoEModule:
    """The load-balancing loss is a product of batch means: each data-parallel rank's, averaged, is not one
    process's on the whole batch (as under plain DDP), so layouts with dp > 1 train without it."""
    return mixtral(output_router_logits=False)


def qwen3_moe(**kw: Any) -> MoEModule:
    sizes = {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **kw}
    return MoEModule("Qwen3MoeConfig", "Qwen3MoeForCausalLM", decoder_sparse_step=1, **sizes)


class ExpertShards(L.Callback):
    """Records, per rank, the local and global element counts of the expert weights once sharded; saves at the end."""

    def __init__(self, path: Any = None) -> None:
        self.path = path
        self.results: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        local = global_ = 0
        for name, param in pl_module.named_parameters():
            if name.rsplit(".", 1)[-1] in EXPERTS and ".experts." in name:
                global_ += param.numel()
                local += param.to_local().numel() if isinstance(param, DTensor) else param.numel()
        self.results[f"experts_rank{trainer.global_rank}"] = (local, global_)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path is not None:
            trainer.save_checkpoint(self.path)


def _longcat_plan() -> dict[str, str]:
    """The explicit plan LongCat-Flash's refusal offers: its MLA attention kept whole, the experts sharded."""
    from tests.parallel.tensor.test_hf_styles import _explicit_plan, _refusal

    return _explicit_plan(_refusal(longcat_flash))


@pytest.fixture(scope="module")
def fits(tmp_path_factory: Any) -> dict[str, Any]:
    """Every fit of this file, by name: the one-process references in one job, then the sharded runs of each world
    size one after the other in one job (``tests/helpers/batched.py``); "checkpoints" holds where the tp=2 runs of
    the MoE models saved."""
    directory = tmp_path_factory.mktemp("experts")
    checkpoints = {name: directory / f"{name}-tp2.ckpt" for name in ("mixtral", "qwen3_moe")}
    tokens = lambda: _tokens(GLOBAL_BATCH)
    reference_runs = {
        "mixtral": Run(mixtral, tokens),
        "qwen3_moe": Run(qwen3_moe, tokens),
        "mixtral-without-aux-loss": Run(mixtral_without_aux_loss, tokens),
        "longcat_flash": Run(longcat_flash, tokens),
    }
    by_devices: dict[int, dict[str, Run]] = {2: {}, 4: {}}
    for name, factory in (("mixtral", mixtral), ("qwen3_moe", qwen3_moe)):
        by_devices[2][f"{name}-tp2"] = Run(
            factory,
            tokens,
            {"tensor_parallel_size": 2, "tp_plan": "auto"},
            callbacks_factory=lambda path=checkpoints[name]: [ExpertShards(path)],
        )
    for name, extra, devices, dp, _ in COMPOSED:
        by_devices[devices][f"mixtral-{name}"] = Run(
            mixtral_without_aux_loss,
            lambda b=GLOBAL_BATCH // dp: _tokens(b),
            {"tensor_parallel_size": 2, **extra},
            callbacks_factory=lambda: [ExpertShards()],
        )
    by_devices[2]["longcat_flash-tp2"] = Run(
        longcat_flash, tokens, {"tensor_parallel_size": 2, "tp_plan": _longcat_plan()}
    )
    trained = {name: r for devices, runs in by_devices.items() for name, r in fit_each(runs, devices, 1200).items()}
    return {"references": references(reference_runs), "trained": trained, "checkpoints": checkpoints}


def _experts_sharded(extras: list[dict[str, Any]], ranks: int, parts: int) -> None:
    """Every rank holds ``1/parts`` of the expert weights (tp, times dp where ZeRO-3 shards them further)."""
    counts = {k: v for extra in extras for k, v in extra.items() if k.startswith("experts_rank")}
    assert len(counts) == ranks, counts
    assert all(global_ > 0 and local * parts == global_ for local, global_ in counts.values()), counts


@pytest.mark.slow  # the slow tier: published model code: Hugging Face MoE models under their own tp plans
@pytest.mark.parametrize("factory", [mixtral, qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_moe_trains_under_tp2_with_its_own_plan_and_loads_into_one_process(factory, fits):
    plan = auto_plan(factory())
    assert plan["model.model.layers.*.mlp.experts"] == "moe_tp_experts"
    assert plan["model.model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert plan["model.model.layers.*.mlp.experts.down_proj"] == "rowwise"
    assert "model.model.layers.*.mlp.gate" not in plan  # the router stays replicated
    name = factory.__name__
    trained, extras = result(fits["trained"][f"{name}-tp2"])
    assert_same_training(result(fits["references"][name]), trained, weight_atol=TP_WEIGHT_ATOL)
    _experts_sharded(extras, ranks=2, parts=2)

    from lightning_mgpu.checkpoint import consolidate

    state = consolidate(fits["checkpoints"][name])["state_dict"]
    single = factory()
    single.load_state_dict(state, strict=True)  # plain FQNs, full shapes
    for key, value in single.state_dict().items():
        torch.testing.assert_close(value, trained.state_dict[key], rtol=0, atol=0, msg=key)


COMPOSED = [  # (name, strategy extras, devices, dp, parts of the expert weights per rank)
    ("dp2-tp2-zero1", {"zero_stage": 1}, 4, 2, 2),
    ("dp2-tp2-zero3", {"zero_stage": 3}, 4, 2, 4),
    ("tp2-sp", {"sequence_parallel": True}, 2, 1, 2),
]


@pytest.mark.slow  # the slow tier: published model code: Hugging Face MoE models under their own tp plans
@pytest.mark.parametrize(("name", "extra", "devices", "dp", "parts"), COMPOSED, ids=[c[0] for c in COMPOSED])
def test_mixtral_experts_compose_with_zero_and_sequence_parallel(fits, name, extra, devices, dp, parts):
    trained, extras = result(fits["trained"][f"mixtral-{name}"])
    assert_same_training(result(fits["references"]["mixtral-without-aux-loss"]), trained, weight_atol=TP_WEIGHT_ATOL)
    _experts_sharded(extras, ranks=devices, parts=parts)


# ------------------------------------------------------------------------------------------- before training
def _placements(module: torch.nn.Module, plan: dict[str, str], tp: int = 2, sp: bool = False) -> dict[str, Any]:
    matched = _match(module, plan)
    styles = {fqn: ExpertsParallel() for fqn, s in matched.items() if s == "moe_tp_experts"}
    place_experts(module, plan, matched, styles, tp, sequence_parallel=sp)
    return {fqn: s.placements for fqn, s in styles.items()}


def test_expert_placements_follow_hugging_face_parameter_styles():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    module = mixtral()
    placed = _placements(module, auto_plan(module))
    assert placed["model.model.layers.1.mlp.experts"] == {
        "gate_up_proj": _StridedShard(1, split_factor=2),
        "down_proj": Shard(2),
    }
    # Llama-4 layout (transposed: [E, H, 2I] and [E, I, H]): its plan says 'packed_rowwise' and 'colwise'.
    transposed = {
        "model.model.layers.*.mlp.experts": "moe_tp_experts",
        "model.model.layers.*.mlp.experts.gate_up_proj": "packed_rowwise",
        "model.model.layers.*.mlp.experts.down_proj": "colwise",
    }
    assert _placements(module, transposed)["model.model.layers.0.mlp.experts"] == {
        "gate_up_proj": _StridedShard(2, split_factor=2),
        "down_proj": Shard(1),
    }


def test_expert_plans_that_cannot_work_fail_naming_the_fix():
    module = mixtral()
    plan = auto_plan(module)
    orphan = {k: v for k, v in plan.items() if not k.endswith("mlp.experts")}
    with pytest.raises(ValueError, match=r"module 'model.model.layers.0.mlp.experts' is not 'moe_tp_experts'.*Add"):
        _placements(module, orphan)
    unplaced = {k: v for k, v in plan.items() if not k.endswith("down_proj")}
    with pytest.raises(ValueError, match=r"places none of its parameters \['down_proj'\].*'packed_colwise'"):
        _placements(module, unplaced)
    odd = qwen3_moe(moe_intermediate_size=30)  # divisible by 2, not by 4
    _placements(odd, auto_plan(odd), tp=2)
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel=True with a mixture-of-experts model that returns its"
        r" router logits, model \(MixtralForCausalLM\).*output_router_logits=False",
    ):
        _placements(module, plan, sp=True)  # found failing mid-step (DTensor's in-place add) before this check
    _placements(mixtral_without_aux_loss(), plan, sp=True)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 must divide.*gate_up_proj: 30 features in each"
        r" of its 2 packed chunks.*Valid tensor_parallel_size values.*\[2, 3, 5",
    ):
        _placements(odd, auto_plan(odd), tp=4)


def longcat_flash() -> HFModule:
    return HFModule(
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        num_layers=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=4,
        ffn_hidden_size=128,
        expert_ffn_hidden_size=32,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
    )


@pytest.mark.slow  # the slow tier: published model code: Hugging Face MoE models under their own tp plans
def test_identity_experts_count_once_in_the_experts_sum(fits):
    """LongCat-Flash routes some tokens to zero-compute experts (``identity_expert``, 'moe_identity_expert') inside
    the experts module whose per-rank outputs are summed: each rank contributes 1/tp of them. Its MLA attention is
    refused by name; the explicit plan offered keeps it whole and shards the experts, identity experts included."""
    plan = _longcat_plan()
    assert plan["model.model.layers.*.mlp.experts.identity_expert"] == "moe_identity_expert"
    module, calls = longcat_flash(), []
    module.model.model.layers[0].mlp.experts.identity_expert.register_forward_hook(lambda *a: calls.append(1))
    module(torch.randint(0, 128, (GLOBAL_BATCH, 32)))
    assert calls, "no token reached an identity expert: the test would not see a wrong share"
    trained, _ = result(fits["trained"]["longcat_flash-tp2"])
    assert_same_training(result(fits["references"]["longcat_flash"]), trained, weight_atol=TP_WEIGHT_ATOL)


def _transposed_experts_worker() -> dict[str, float]:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from lightning_mgpu.parallel.tensor.experts import parameter_placement

    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
    reference = Llama4TextExperts(config)
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.1)
    sharded = copy.deepcopy(reference)
    styles = {g.rsplit(".", 1)[-1]: s for g, s in config.base_model_tp_plan.items() if ".experts." in g}
    placed = {leaf: parameter_placement(styles[leaf], leaf, p) for leaf, p in sharded.named_parameters()}
    parallelize_module(sharded, init_device_mesh("cpu", (2,)), ExpertsParallel(placed))
    x = torch.randn(4 * 6, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = reference(x1), sharded(x2)
    (y1**2).sum().backward()
    (y2**2).sum().backward()
    grads = [(p.grad, q.grad.full_tensor()) for p, q in zip(reference.parameters(), sharded.parameters())]
    return {
        "placed": sorted(str(p) for p in placed.values()),
        "local": tuple(sharded.gate_up_proj.to_local().shape),
        "out": float((y1 - y2).abs().max() / y1.abs().max()),
        "x": float((x1.grad - x2.grad).abs().max()),
        "weights": max(float((a - b).abs().max() / a.abs().max()) for a, b in grads),
    }


def test_transposed_experts_of_llama4_shard_by_their_plan():
    """Llama-4 stores experts transposed ([E, H, 2I], [E, I, H]); its plan says 'packed_rowwise' and 'colwise',
    which place the packed intermediate dimension last and the down projection's first: like one process."""
    from tests.helpers.distributed import run_distributed

    result = run_distributed(_transposed_experts_worker, 2, timeout=120)[0]
    assert result["placed"] == ["S(1)", "_S(2, 2)"] and result["local"] == (4, 64, 32), result
    assert result["out"] < 1e-6 and result["x"] < 1e-5 and result["weights"] < 1e-5, result
