"""torch's fused CPU attention kernels with their log-sum-exp (checked on torch 2.13.0).

``F.scaled_dot_product_attention`` returns the attention output only; ring attention merges partial results over
key/value blocks and needs each block's log-sum-exp, and its backward needs the kernel's backward given the merged
output and log-sum-exp. On CPU those are the aten operators behind SDPA's flash path,
``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (torch's own context parallelism uses the
CUDA counterparts). Both accept fewer key/value heads than query heads (grouped-query attention).

``attn_implementation``: a Hugging Face config's ``_attn_implementation`` (``"sdpa"``, ``"eager"``,
``"flex_attention"``, ...), the attribute transformers' own documentation reads to tell which attention a model
runs; transformers has no public accessor.
"""

from __future__ import annotations

import torch

from lightning_mgpu._compat import changed


def _operator(name: str) -> torch._ops.OpOverloadPacket:
    operator = getattr(torch.ops.aten, name, None)
    if operator is None:
        raise AttributeError(changed(f"torch.ops.aten.{name}", "torch", "the operator is gone"))
    return operator


def cpu_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)``: output ``(B, H, Tq, D)`` in the inputs' dtype, logsumexp ``(B, H, Tq)`` in fp32."""
    return _operator("_scaled_dot_product_flash_attention_for_cpu")(query, key, value, 0.0, is_causal, scale=scale)


def cpu_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value for one key/value block, given the *merged* ``out`` and ``logsumexp``."""
    backward = _operator("_scaled_dot_product_flash_attention_for_cpu_backward")
    return backward(grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)


def attn_implementation(config: object) -> str | None:
    """The attention a Hugging Face config selects; None for an object that is not such a config."""
    value = getattr(config, "_attn_implementation", None)
    return value if isinstance(value, str) else None
