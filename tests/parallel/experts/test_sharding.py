"""Expert parallelism (``parallel/experts/``): Hugging Face MoE models as shipped, experts split over an ``ep`` axis
carved out of data parallelism, trained like one process on the same global batches."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_mgpu import ScalingMonitor
from lightning_mgpu.parallel.experts.sharding import _FUSED, check_experts, find_experts
from tests.helpers.equivalence import LOSS_RTOL, assert_same_training, fit
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.tiers import case
from tests.parallel.tensor.test_experts import mixtral, mixtral_without_aux_loss, qwen3_moe
from tests.parallel.tensor.test_hf_styles import GLOBAL_BATCH, STEPS, TP_WEIGHT_ATOL

transformers = pytest.importorskip("transformers")
SEQUENCE = 16  # tokens per sample
SMALL = {"hidden_size": 32, "intermediate_size": 64}  # 4 heads of 8 (2 key/value heads: tp 2 splits them too)


def _tokens(batch: int) -> RandomTokenDataModule:
    return RandomTokenDataModule(seq_len=SEQUENCE, batch_size=batch)


def _mixtral_without_aux_loss() -> Any:
    return mixtral(output_router_logits=False, **SMALL)


_REFERENCES: dict[str, Any] = {}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One process's run of a model factory (losses, weights, expert probes and token counts), once per module."""

    def run(factory: Any) -> Any:
        if factory.__name__ not in _REFERENCES:
            path = tmp_path_factory.mktemp(f"one-{factory.__name__}")
            _REFERENCES[factory.__name__] = fit(
                factory,
                lambda: _tokens(GLOBAL_BATCH),
                None,
                1,
                STEPS,
                callbacks_factory=lambda: [ExpertProbe(), ExpertTokens(path)],
            )[0]
        return _REFERENCES[factory.__name__]

    return run


class ExpertProbe(L.Callback):
    """Per rank: the element count of the expert weights it holds, and its experts' first gradients and final
    weights, keyed by parameter name and the global index of the rank's first expert."""

    def __init__(self, path: Any = None) -> None:
        self.path = path
        self.results: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        held = sum(_local(p).numel() for m in find_experts(pl_module).values() for p in m.parameters())
        self.results[f"experts_rank{trainer.global_rank}"] = held

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.results[f"grads_rank{trainer.global_rank}"] = self._experts(trainer, pl_module, grads=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results[f"weights_rank{trainer.global_rank}"] = self._experts(trainer, pl_module, grads=False)
        if self.path is not None:
            trainer.save_checkpoint(self.path)

    @staticmethod
    def _experts(trainer: L.Trainer, pl_module: L.LightningModule, grads: bool) -> dict[tuple[str, int], Any]:
        out = {}
        for name, module in find_experts(pl_module).items():
            for leaf, param in module.named_parameters():
                value = _whole(param.grad if grads else param).detach().clone()
                out[(f"{name}.{leaf}", 0)] = value  # every expert, gathered over ep and replicas
        return out


class ExpertTokens(ScalingMonitor):
    """The ScalingMonitor's per-expert token counts (global rank 0's report)."""

    def __init__(self, path: Any) -> None:
        super().__init__(dirpath=path, verbose=False, measure_activations=False)

    @property
    def results(self) -> dict[str, Any]:
        return {"expert_tokens": self.report["experts"]} if self.report is not None else {}


def _assert_same_expert_tokens(reference: dict[str, Any], result: dict[str, Any], assignments: int) -> None:
    """Every layer's counts add up to the (token, expert) assignments of the run and match one process's (a
    near-tie in the router may flip a token or two between the runs)."""
    expected, got = reference["expert_tokens"], result["expert_tokens"]
    assert expected and sorted(got) == sorted(expected), (got, expected)
    for name, layer in got.items():
        assert sum(layer["tokens"]) == sum(expected[name]["tokens"]) == assignments, (name, layer, assignments)
        assert all(abs(a - b) <= 2 for a, b in zip(layer["tokens"], expected[name]["tokens"])), (name, layer, expected)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """Every expert, gathered over the ep ranks and the replicas that shard them (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _assert_experts_match(reference: dict[str, Any], extras: list[dict[str, Any]], kind: str, **tol: float) -> None:
    """Each rank's experts equal the reference's at the same global expert indices; every expert weight is seen
    (by every rank, or with pipelining by the ranks of its stage)."""
    full = reference[f"{kind}_rank0"]
    seen = set()
    for extra in extras:
        held = next(v for k, v in extra.items() if k.startswith(kind))
        assert held, "a rank holds no experts"
        for (name, first), value in held.items():
            expected = full[(name, 0)][first : first + value.shape[0]]
            torch.testing.assert_close(value, expected, msg=lambda m: f"{kind} {name}[{first}:]: {m}", **tol)
            seen.add(name)
    assert seen == {name for name, _ in full}, (seen, list(full))


def _expert_count(factory: Any) -> int:
    return sum(p.numel() for m in find_experts(factory()).values() for p in m.parameters())


def _assert_same_losses_and_dense_weights(reference: Any, result: Any) -> None:
    torch.testing.assert_close(
        torch.tensor(result.losses, dtype=torch.float64),
        torch.tensor(reference.losses, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0.0,
        msg=lambda m: f"{m}\nref={reference.losses}\ngot={result.losses}",
    )
    dense = [k for k in reference.state_dict if ".experts." not in k and not k.endswith(_FUSED)]
    assert dense and set(dense) <= set(result.state_dict)
    for key in dense:
        torch.testing.assert_close(
            result.state_dict[key],
            reference.state_dict[key],
            rtol=1e-4,
            atol=TP_WEIGHT_ATOL,
            msg=lambda m: f"{key}: {m}",
        )


class Expert(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class TopKMoE(torch.nn.Module):
    """A mixture of experts as a user writes it: a linear router, softmax top-k gating, a loop over the experts
    that skips those no token chose, and a Switch-style load-balancing loss kept on the module."""

    def __init__(self, dim: int = 32, hidden: int = 64, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.top_k = top_k
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == i)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, weights[token, slot, None] * expert(x[token]))
        fraction = torch.nn.functional.one_hot(chosen, len(self.experts)).float().sum(1).mean(0)
        self.aux_loss = len(self.experts) * (fraction * probs.mean(0)).sum()
        return out.reshape(shape)


class TorchMoEModule(L.LightningModule):
    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2, aux_weight: float = 0.0) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        self.moes = torch.nn.ModuleList(TopKMoE(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)
        self.aux_weight = aux_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        loss = loss + self.aux_weight * sum(moe.aux_loss for moe in self.moes)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


TORCH_LAYOUTS = [  # (name, strategy extras, devices)
    pytest.param("ep2", {}, 2, id="ep2", marks=pytest.mark.slow),  # the slow tier: ep alone (quick: beside dp)
    pytest.param("dp2xep2-zero3", {"zero_stage": 3}, 4, id="dp2xep2-zero3"),
]


@pytest.mark.parametrize(("name", "extra", "devices"), TORCH_LAYOUTS)
def test_a_hand_written_torch_moe_splits_over_ep_and_trains_like_one_process(
    name, extra, devices, one_process, tmp_path
):
    """Experts of an nn.ModuleList: each rank keeps its own under their indices (plain FQNs); the block's gating
    code runs unchanged (twice: calls recorded, then answered after one all-to-all each way). The checkpoint holds
    every expert once and loads strictly into one process."""
    from lightning_mgpu.checkpoint import consolidate

    reference = one_process(TorchMoEModule)
    result, extras = fit(
        TorchMoEModule,
        lambda: _tokens(GLOBAL_BATCH // devices),
        {"data_parallel_size": devices, "expert_parallel_size": 2, **extra},
        devices,
        STEPS,
        callbacks_factory=lambda: [ListedExperts(tmp_path / "ep.ckpt"), ExpertTokens(tmp_path)],
    )
    _assert_same_losses_and_dense_weights(reference, result)
    _assert_same_expert_tokens(reference.extra, result.extra, GLOBAL_BATCH * SEQUENCE * 2 * STEPS)  # top-2
    single = TorchMoEModule()
    single.load_state_dict(consolidate(tmp_path / "ep.ckpt")["state_dict"], strict=True)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict[key], rtol=1e-4, atol=TP_WEIGHT_ATOL, msg=key)
    for rank, extra in enumerate(extras):
        names, weights = extra["experts"]
        ep_rank = rank % 2
        assert names == {f"moes.{layer}.experts.{i}" for layer in (0, 1) for i in (2 * ep_rank, 2 * ep_rank + 1)}
        for key, value in weights.items():  # rank 1 holds experts 2 and 3 under their own names
            torch.testing.assert_close(value, reference.state_dict[key], rtol=1e-4, atol=TP_WEIGHT_ATOL, msg=key)


class ListedExperts(L.Callback):
    def __init__(self, path: Any = None) -> None:
        self.path = path
        self.results: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        names = {f"moes.{i}.experts.{k}" for i, moe in enumerate(pl_module.moes) for k in moe.experts._modules}
        weights = {n: _whole(p).detach().clone() for n, p in pl_module.named_parameters() if ".experts." in n}
        self.results["experts"] = (names, weights)
        if self.path is not None:
            trainer.save_checkpoint(self.path)


def mixtral_with_aux_loss() -> Any:
    """Hugging Face's load-balancing loss weighted so that each rank's own (plain DDP's) would differ from one
    process's by ~3e-4 relative per step: one process's is what ep layouts must reproduce."""
    return mixtral(router_aux_loss_coef=0.5, **SMALL)


def qwen3_moe_with_aux_loss() -> Any:
    return qwen3_moe(router_aux_loss_coef=0.5, hidden_size=32, head_dim=8)


LAYOUTS = [  # (name, model, strategy extras, devices, dp, experts per rank divided by)
    ("mixtral-ep2", mixtral_with_aux_loss, {"expert_parallel_size": 2}, 2, 2, 2),
    ("qwen3_moe-ep2-zero3", qwen3_moe_with_aux_loss, {"expert_parallel_size": 2, "zero_stage": 3}, 2, 2, 2),
    # Experts also shard over their replicas with FSDP2 (at every ZeRO stage): 1/dp of them per rank. ZeRO-1 steps
    # them on every rank (each its own shard) and shards the other parameters' optimizer states over dp.
    (
        "mixtral-dp2xep2-zero1-checkpointed",
        mixtral_with_aux_loss,
        {"expert_parallel_size": 2, "zero_stage": 1, "activation_checkpointing": True},
        4,
        4,
        4,
    ),
    ("mixtral-dp2xep2-zero2", mixtral_with_aux_loss, {"expert_parallel_size": 2, "zero_stage": 2}, 4, 4, 4),
    # Experts inside pipeline stages, ep over the stage's data-parallel ranks: a rank holds half the experts of
    # half the layers. (Under pipelining the load-balancing loss would see the last stage's layers only: refused.)
    (
        "mixtral-pp2xep2-zero1",
        _mixtral_without_aux_loss,
        {"expert_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1},
        4,
        2,
        4,
    ),
    # Tensor parallelism of the attention (the model's own plan without its expert entries), experts whole on both
    # tensor-parallel ranks and split over ep.
    (
        "mixtral-dp2xtp2xep2-zero3",
        mixtral_with_aux_loss,
        {"expert_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3},
        4,
        2,
        2,
    ),
]


# The slow tier: Mixtral at ep 2 alone (the quick tier trains ep 2 alone on Qwen3-MoE and the hand-written MoE, and
# Mixtral in every other layout).
SLOW_LAYOUTS = {"mixtral-ep2"}


@pytest.mark.parametrize(
    ("name", "factory", "extra", "devices", "dp", "parts"),
    [case(*layout, id=layout[0], slow=layout[0] in SLOW_LAYOUTS) for layout in LAYOUTS],
)
def test_experts_split_over_ep_train_like_one_process(name, factory, extra, devices, dp, parts, one_process, tmp_path):
    """Losses (load-balancing loss included: one process's, not each data-parallel rank's own), first gradients and
    final weights of every expert as one process; the checkpoint keeps Hugging Face's names and global shapes and
    loads strictly into one process."""
    reference = one_process(factory)
    ckpt = tmp_path / "ep.ckpt"
    result, extras = fit(
        factory,
        lambda: _tokens(GLOBAL_BATCH // dp),
        {"data_parallel_size": dp, **extra},
        devices,
        STEPS,
        callbacks_factory=lambda: [ExpertProbe(ckpt), ExpertTokens(tmp_path)],
    )
    assert_same_training(reference, result, weight_atol=TP_WEIGHT_ATOL)  # every key, full shapes
    # Activation checkpointing recomputes the experts in backward: not counted twice. (A pipeline schedule's
    # shape-inference forward at the first step is counted: left out here.)
    if "pipeline_parallel_size" not in extra:
        _assert_same_expert_tokens(reference.extra, result.extra, GLOBAL_BATCH * SEQUENCE * 2 * STEPS)  # top-2
    _assert_experts_match(reference.extra, extras, "grads", rtol=1e-4, atol=1e-6)
    _assert_experts_match(reference.extra, extras, "weights", rtol=1e-4, atol=TP_WEIGHT_ATOL)
    held = {k: v for e in extras for k, v in e.items() if k.startswith("experts_rank")}
    assert len(held) == devices and all(v * parts == _expert_count(factory) for v in held.values()), held

    from lightning_mgpu.checkpoint import consolidate

    single = factory()
    single.load_state_dict(consolidate(ckpt)["state_dict"], strict=True)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(value, result.state_dict[key], rtol=0, atol=0, msg=key)


def test_expert_parallel_refuses_what_it_cannot_do_before_training():
    from lightning_mgpu import HybridStrategy

    with pytest.raises(ValueError, match=r"`expert_parallel_size` must be a positive integer, got 0"):
        HybridStrategy(expert_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 must divide data_parallel_size=2.*\[1, 2\]"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(expert_parallel_size=4))
    with pytest.raises(NotImplementedError, match=r"does not compose with sequence_parallel.*sequence_parallel=False"):
        L.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=HybridStrategy(expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True),
        )
    from lightning_mgpu.parallel.experts.router_loss import check_no_router_loss

    with pytest.raises(NotImplementedError, match=r"MixtralForCausalLM's load-balancing loss.*output_router_logits=Fa"):
        check_no_router_loss(mixtral(), "pipeline_parallel_size=2")  # what pp x ep checks at setup
    check_no_router_loss(mixtral_without_aux_loss(), "pipeline_parallel_size=2")
    with pytest.raises(ValueError, match=r"expert_parallel_size=2, but Linear has no mixture-of-experts layer"):
        check_experts(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match=r"must divide every layer's expert count.*\[4\]"):
        check_experts(mixtral_without_aux_loss(), 8)


def test_checkpoint_saved_at_ep2_resumes_at_dp2_zero3_and_on_one_process(tmp_path):
    """The ep 2 checkpoint (experts as DTensors over ep) resumes at dp 2 ZeRO-3 with ep 1, and on one process, like
    the run that saved it (losses within 1e-5; weights and optimizer states as saved)."""
    from tests.test_checkpoint import CROSS_LAYOUT_RTOL, SaveAt, _assert_same_states, _losses_match, _resume

    factory = _mixtral_without_aux_loss
    data = lambda: _tokens(GLOBAL_BATCH // 2)
    reference, _ = fit(
        factory,
        data,
        {"data_parallel_size": 2, "expert_parallel_size": 2},
        2,
        4,
        callbacks_factory=lambda: [SaveAt(tmp_path, (2,))],
    )
    for devices, kwargs, batch in ((2, {"zero_stage": 3}, GLOBAL_BATCH // 2), (1, {}, GLOBAL_BATCH)):
        out = tmp_path / f"dp{devices}"
        out.mkdir()
        resumed = _resume(
            tmp_path, tmp_path / "step2.ckpt", devices, kwargs, out, factory, lambda batch=batch: _tokens(batch), 4
        )
        _losses_match(reference.losses, resumed.losses, 2, CROSS_LAYOUT_RTOL)
        _assert_same_states(tmp_path / "step2.ckpt", out / "resaved.ckpt")


def test_hugging_face_moe_layers_are_found_and_the_rest_left_alone():
    """Mixtral, Qwen3-MoE and OLMoE as shipped: one experts module per layer (fused 3-D weights), router untouched."""
    from tests.parallel.tensor.test_hf_styles import HFModule

    olmoe = HFModule("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2)
    for module in (mixtral_without_aux_loss(), qwen3_moe(), olmoe):
        found = find_experts(module)
        assert sorted(found) == [f"model.model.layers.{i}.mlp.experts" for i in range(2)], (type(module), found)
    assert not find_experts(TorchMoEModule())  # a ModuleList of experts is the other kind
    llama4 = transformers.models.llama4.modeling_llama4.Llama4TextExperts(
        transformers.Llama4TextConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
    )
    assert not find_experts(llama4)  # called with tokens already grouped per expert, not with the routing
    from lightning_mgpu.parallel.experts.sharding import find_expert_lists

    assert sorted(find_expert_lists(TorchMoEModule())) == ["moes.0", "moes.1"]
    assert not find_expert_lists(mixtral_without_aux_loss())  # its decoder layers have no router beside them


def test_checkpointing_a_torch_moe_block_under_ep_is_refused_at_setup():
    with pytest.raises(RuntimeError, match=r"activation checkpointing of TopKMoE.*activation_checkpointing=False"):
        fit(
            TorchMoEModule,
            lambda: RandomTokenDataModule(batch_size=4),
            {"data_parallel_size": 2, "expert_parallel_size": 2, "activation_checkpointing": True},
            2,
            1,
        )
