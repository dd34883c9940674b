"""Expert parallelism (``parallel/experts.py``): Hugging Face MoE models as shipped, experts split over an ``ep`` axis
carved out of data parallelism, trained like one process on the same global batches."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_mgpu.parallel.experts import check_experts, find_experts
from tests.helpers.equivalence import LOSS_RTOL, fit
from tests.parallel.test_tensor_experts import mixtral_without_aux_loss, qwen3_moe
from tests.parallel.test_tensor_hf_styles import GLOBAL_BATCH, STEPS, TP_WEIGHT_ATOL, _tokens

pytest.importorskip("transformers")


class ExpertProbe(L.Callback):
    """Per rank: the element count of the expert weights it holds, and its experts' first gradients and final
    weights, keyed by parameter name and the global index of the rank's first expert."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        held = sum(_local(p).numel() for m in find_experts(pl_module).values() for p in m.parameters())
        self.results[f"experts_rank{trainer.global_rank}"] = held

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.results[f"grads_rank{trainer.global_rank}"] = self._experts(trainer, pl_module, grads=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results[f"weights_rank{trainer.global_rank}"] = self._experts(trainer, pl_module, grads=False)

    @staticmethod
    def _experts(trainer: L.Trainer, pl_module: L.LightningModule, grads: bool) -> dict[tuple[str, int], Any]:
        ep = getattr(trainer.strategy, "options", None)
        ep_rank = trainer.global_rank % (ep.expert_parallel_size if ep is not None else 1)  # dp-only worlds
        out = {}
        for name, module in find_experts(pl_module).items():
            for leaf, param in module.named_parameters():
                value = _local(param.grad if grads else param).detach().clone()
                out[(f"{name}.{leaf}", ep_rank * value.shape[0])] = value
        return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _assert_experts_match(reference: dict[str, Any], extras: list[dict[str, Any]], kind: str, **tol: float) -> None:
    """Each rank's experts equal the reference's at the same global expert indices."""
    full = reference[f"{kind}_rank0"]
    seen = 0
    for extra in extras:
        for (name, first), value in next(v for k, v in extra.items() if k.startswith(kind)).items():
            expected = full[(name, 0)][first:first + value.shape[0]]
            torch.testing.assert_close(value, expected, msg=lambda m: f"{kind} {name}[{first}:]: {m}", **tol)
            seen += 1
    assert seen == len(extras) * len(full), (seen, len(full))  # every rank: a slice of every expert weight


def _expert_count(factory: Any) -> int:
    return sum(p.numel() for m in find_experts(factory()).values() for p in m.parameters())


def _assert_same_losses_and_dense_weights(reference: Any, result: Any) -> None:
    torch.testing.assert_close(torch.tensor(result.losses, dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=LOSS_RTOL, atol=0.0)
    dense = [k for k in reference.state_dict if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert dense and set(dense) <= set(result.state_dict)
    for key in dense:
        torch.testing.assert_close(result.state_dict[key], reference.state_dict[key], rtol=1e-4, atol=TP_WEIGHT_ATOL,
                                   msg=lambda m: f"{key}: {m}")


LAYOUTS = [  # (name, model, strategy extras, devices, dp, experts per rank divided by)
    ("mixtral-ep2", mixtral_without_aux_loss, {"expert_parallel_size": 2}, 2, 2, 2),
    ("qwen3_moe-ep2-zero3", lambda: qwen3_moe(output_router_logits=False),
     {"expert_parallel_size": 2, "zero_stage": 3}, 2, 2, 2),
    ("mixtral-dp2xep2", mixtral_without_aux_loss, {"expert_parallel_size": 2}, 4, 4, 2),
]


@pytest.mark.parametrize(("name", "factory", "extra", "devices", "dp", "parts"), LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_experts_split_over_ep_train_like_one_process(name, factory, extra, devices, dp, parts):
    reference, _ = fit(factory, lambda: _tokens(GLOBAL_BATCH), None, 1, STEPS, callbacks_factory=lambda: [ExpertProbe()])
    result, extras = fit(factory, lambda: _tokens(GLOBAL_BATCH // dp), {"data_parallel_size": dp, **extra}, devices,
                         STEPS, callbacks_factory=lambda: [ExpertProbe()])
    _assert_same_losses_and_dense_weights(reference, result)
    _assert_experts_match(reference.extra, extras, "grads", rtol=1e-4, atol=1e-6)
    _assert_experts_match(reference.extra, extras, "weights", rtol=1e-4, atol=TP_WEIGHT_ATOL)
    held = {k: v for e in extras for k, v in e.items() if k.startswith("experts_rank")}
    assert len(held) == devices and all(v * parts == _expert_count(factory) for v in held.values()), held


def test_expert_parallel_refuses_what_it_cannot_do_before_training():
    from lightning_mgpu import HybridStrategy

    with pytest.raises(ValueError, match=r"`expert_parallel_size` must be a positive integer, got 0"):
        HybridStrategy(expert_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 must divide data_parallel_size=2.*\[1, 2\]"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(expert_parallel_size=4))
    with pytest.raises(NotImplementedError, match=r"does not compose with zero_stage=1"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(expert_parallel_size=2, zero_stage=1))
    with pytest.raises(ValueError, match=r"expert_parallel_size=2, but Linear has no mixture-of-experts layer"):
        check_experts(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match=r"must divide every layer's expert count.*\[4\]"):
        check_experts(mixtral_without_aux_loss(), 8)
