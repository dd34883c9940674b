"""The peers written by hand, as Lightning's ``ModelParallelStrategy`` docs write them: the demo GPT's tensor-parallel
plan for torch's ``parallelize_module`` (what ``tp_plan="auto"`` does, spelled out) and FSDP2 per block then root, in
``configure_model``. ``bench_tensor.py`` and ``bench_peers.py`` compare HybridStrategy with them.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from lightning_mgpu.demo import GPT


def parallelize_by_hand(gpt: GPT, tp_mesh: Any, sequence_parallel: bool) -> None:
    """What ``tp_plan="auto"`` does to the demo GPT, written out for torch's ``parallelize_module``.

    The style objects come from ``lightning_mgpu.parallel.tensor.style``: identical to the auto plan's (fused
    q|k|v as ``_Colwise(chunks=3)``, i.e. ``_StridedShard`` so each rank keeps the q, k and v of its own heads).
    Every DTensor parameter gets the hook the auto plan arms, which gives its gradient its own layout once after
    backward (Megatron's single reduction) instead of letting AdamW redistribute it on every use.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    sp, tp = sequence_parallel, tp_mesh.size()
    for block in gpt.transformer.h:
        plan = {"attn.c_attn": "colwise_qkv", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
        plan.update({"ln_1": "sequence_parallel", "ln_2": "sequence_parallel"} if sp else {})
        parallelize_module(block, tp_mesh, _styles(plan, sp))
        block.attn.n_head //= tp  # the attention's view(B, T, n_head, hs) must see this rank's heads
        block.attn.n_embd //= tp
    if sp:
        top = {
            "transformer.wte": "embedding_rowwise",
            "transformer.ln_f": "sequence_parallel",
            "lm_head": "colwise_gather_output",
        }
        parallelize_module(gpt, tp_mesh, _styles(top, sp))
        # The residual stream is a DTensor: every other parameter (wpe) must be one too, replicated.
        for module in gpt.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    replicated = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                    module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
    arm_gradient_layout(gpt)


def _styles(plan: dict[str, str], sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The torch styles of ``{fqn: style name}`` (none of these names is ``"replicate"``, the one without a style)."""
    from lightning_mgpu.parallel.tensor import style

    styles = {fqn: style(name, sequence_parallel) for fqn, name in plan.items()}
    return {fqn: s for fqn, s in styles.items() if s is not None}


def arm_gradient_layout(module: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    from lightning_mgpu.parallel.tensor import keep_grad_placement

    for param in module.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            # once, also where module.to() kept a stale one (torch annotates the attribute as a dict; None is unset)
            param._post_accumulate_grad_hooks = None  # type: ignore[assignment]
            param.register_post_accumulate_grad_hook(keep_grad_placement)


def step_context(sequence_parallel: bool) -> Any:
    if not sequence_parallel:
        return nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def by_hand_module(kwargs: dict[str, Any], sequence_parallel: bool = False, rehook: bool = False) -> Any:
    """The demo module with the tp plan (over the ``tensor_parallel`` mesh, when larger than 1) and FSDP2 (over
    ``data_parallel``, when larger than 1) applied by hand in ``configure_model``; ``rehook``: see ``on_fit_start``."""
    import torch

    from lightning_mgpu.demo import GPTLightningModule

    sp = sequence_parallel

    class ByHand(GPTLightningModule):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh
            assert mesh is not None  # ModelParallelStrategy sets it before configure_model
            if mesh["tensor_parallel"].size() > 1:
                parallelize_by_hand(self.model, mesh["tensor_parallel"], sp)
            dp_mesh = mesh["data_parallel"]
            if dp_mesh.size() > 1:
                for block in self.model.transformer.h:
                    fully_shard(block, mesh=dp_mesh)
                fully_shard(self.model, mesh=dp_mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            with step_context(sp):
                return super().training_step(batch, batch_idx)

        def backward(self, loss: torch.Tensor, *args: Any, **kw: Any) -> None:
            with step_context(sp):
                super().backward(loss, *args, **kw)

        def on_fit_start(self) -> None:
            # ModelParallelStrategy.setup() calls module.to(device) after configure_model: nn.Module._apply swaps
            # DTensor parameters (torch.utils.swap_tensors) and their post-accumulate-grad hooks stop firing.
            if rehook:
                arm_gradient_layout(self)

    return ByHand(**kwargs)
