"""torch's fused attention kernels with their log-sum-exp (checked on torch 2.13.0).

``F.scaled_dot_product_attention`` returns the attention output only; ring attention merges partial results over
key/value blocks and needs each block's log-sum-exp, and its backward needs the kernel's backward given the merged
output and log-sum-exp. Those are the aten operators behind SDPA's fused paths, the ones torch's own context
parallelism (``torch.distributed.tensor.experimental.context_parallel``) calls:

- ``"flash_cpu"``: ``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``;
- ``"flash"`` (CUDA): ``_scaled_dot_product_flash_attention`` and its ``_backward``;
- ``"efficient"`` (CUDA, memory-efficient): ``_scaled_dot_product_efficient_attention`` and its ``_backward``;
- ``"cudnn"`` (CUDA): ``_scaled_dot_product_cudnn_attention`` and its ``_backward``.

:func:`fused_attention` and :func:`fused_attention_backward` give every kernel one shape: the output in the inputs'
dtype and the log-sum-exp as ``(B, H, Tq)`` fp32. The kernels differ underneath: the memory-efficient one pads its
log-sum-exp to a multiple of 32 queries (the padding +inf, which its backward relies on), cuDNN's keeps a trailing
dimension of 1, and the CUDA backwards take the forward's bookkeeping (sequence offsets, lengths, the dropout RNG
state), which for dense inputs without dropout carries nothing but the lengths: it is rebuilt here from the shapes,
as the forward returns it (no offsets, empty RNG tensors). Grouped-query attention (fewer key/value heads) is passed
through as given; which kernels take it is the caller's choice (``parallel/context/kernels.py``).

``attn_implementation``: a Hugging Face config's ``_attn_implementation`` (``"sdpa"``, ``"eager"``,
``"flex_attention"``, ...), the attribute transformers' own documentation reads to tell which attention a model
runs; transformers has no public accessor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_mgpu._compat import changed

# Kernel -> (forward operator, backward operator), and each operator's arguments in schema order, which the calls
# below pass by position (``attn_mask`` left at its default), checked against this torch by tests/_compat
# (the CUDA-only operators exist, with their schemas, on CPU builds too).
OPERATORS: dict[str, tuple[str, str]] = {
    kernel: (f"_scaled_dot_product_{name}", f"_scaled_dot_product_{name}_backward")
    for kernel, name in {
        "flash_cpu": "flash_attention_for_cpu",
        "flash": "flash_attention",
        "efficient": "efficient_attention",
        "cudnn": "cudnn_attention",
    }.items()
}
ARGUMENTS: dict[str, tuple[str, ...]] = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        "query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale",
    ),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale",
    ),
    "_scaled_dot_product_flash_attention": (
        "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale",
    ),
    "_scaled_dot_product_flash_attention_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale",
    ),
    "_scaled_dot_product_efficient_attention": (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale",
    ),
    "_scaled_dot_product_efficient_attention_backward": (
        "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
        "dropout_p", "grad_input_mask", "is_causal", "scale",
    ),
    "_scaled_dot_product_cudnn_attention": (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask",
        "scale",
    ),
    "_scaled_dot_product_cudnn_attention_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
        "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale",
    ),
}  # fmt: skip
_EFFICIENT_LSE_ALIGNMENT = 32  # the memory-efficient kernel's log-sum-exp rows, padded with +inf


def operator(name: str) -> torch._ops.OpOverloadPacket:
    """``torch.ops.aten.<name>``, or an error naming the operator and the torch it was checked on."""
    found = getattr(torch.ops.aten, name, None)
    if found is None:
        raise AttributeError(changed(f"torch.ops.aten.{name}", "torch", "the operator is gone"))
    return found


def fused_attention(
    kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)`` of one block through ``kernel`` (a key of :data:`OPERATORS`): output ``(B, H, Tq,
    Dv)`` in the inputs' dtype, logsumexp ``(B, H, Tq)`` in fp32. Inputs contiguous, no dropout."""
    forward = operator(_operators(kernel)[0])
    if kernel == "flash_cpu":
        out, lse = forward(query, key, value, 0.0, is_causal, scale=scale)
    elif kernel == "flash":
        out, lse, *_ = forward(query, key, value, 0.0, is_causal, False, scale=scale)
    elif kernel == "efficient":
        out, lse, *_ = forward(query, key, value, None, True, 0.0, is_causal, scale=scale)
        lse = lse[..., : query.shape[2]]
    else:  # cudnn
        out, lse, *_ = forward(query, key, value, None, True, 0.0, is_causal, False, scale=scale)
        lse = lse.reshape(query.shape[:3])
    return out, lse.float()


def fused_attention_backward(
    kernel: str,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value for one key/value block given the *merged* ``out`` and ``logsumexp``
    (``(B, H, Tq)`` fp32, as :func:`fused_attention` returns it). Inputs contiguous."""
    backward = operator(_operators(kernel)[1])
    q_len, kv_len = query.shape[2], key.shape[2]
    if kernel == "flash_cpu":
        return backward(grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)
    seed, offset = _no_dropout_state()
    if kernel == "flash":
        return backward(
            grad_out, query, key, value, out, logsumexp, None, None, q_len, kv_len, 0.0, is_causal, seed, offset,
            scale=scale,
        )  # fmt: skip
    if kernel == "efficient":
        padded = _padded_rows(logsumexp, _EFFICIENT_LSE_ALIGNMENT)
        grads = backward(
            grad_out, query, key, value, None, out, padded, seed, offset, 0.0, [True, True, True, False], is_causal,
            scale=scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2]
    return backward(  # cudnn
        grad_out, query, key, value, out, logsumexp.unsqueeze(-1).contiguous(), seed, offset, None, None, None,
        q_len, kv_len, 0.0, is_causal, scale=scale,
    )  # fmt: skip


def _operators(kernel: str) -> tuple[str, str]:
    if kernel not in OPERATORS:
        raise ValueError(f"No fused attention kernel {kernel!r}; known: {sorted(OPERATORS)}.")
    return OPERATORS[kernel]


def _no_dropout_state() -> tuple[torch.Tensor, torch.Tensor]:
    """The RNG seed and offset the CUDA forwards return without dropout (empty int64 scalars, read only under
    dropout)."""
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def _padded_rows(logsumexp: torch.Tensor, alignment: int) -> torch.Tensor:
    """``(B, H, Tq)`` -> ``(B, H, ceil(Tq / alignment) * alignment)``, padded with +inf as the kernel pads it."""
    missing = -logsumexp.shape[-1] % alignment
    return F.pad(logsumexp, (0, missing), value=float("inf")).contiguous()


def attn_implementation(config: object) -> str | None:
    """The attention a Hugging Face config selects; None for an object that is not such a config."""
    value = getattr(config, "_attn_implementation", None)
    return value if isinstance(value, str) else None
