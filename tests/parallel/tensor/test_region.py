"""Tensor parallelism for code that reshapes with global sizes (issue 11, item 1).

Karpathy's nanoGPT attention reads ``C`` from its unsharded input and splits/reshapes with ``self.n_embd`` and
``self.n_head``; litgpt reshapes with ``config.n_head``, ``config.head_size`` and re-assembles with
``head_size * n_head``. Both are run unchanged: inside their attention and MLP the projections hand back DTensors
with the global shapes (``lightning_mgpu/parallel/tensor/region.py``), and nothing in the modules is rewritten.
"""

from __future__ import annotations

import functools
import re
import warnings
from functools import partial

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.distributed import run_distributed, run_each, traceback_of
from tests.helpers.equivalence import assert_same_training
from tests.helpers.litgpt import LitGPTModule
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule
from tests.helpers.tiers import case

GLOBAL_BATCH = 8
STEPS = 10
TP_WEIGHT_ATOL = 1e-4  # as in test_tensor.py: AdamW turns reduction-order noise on near-zero gradients into ~1e-5


def _tokens(batch: int) -> RandomTokenDataModule:
    return RandomTokenDataModule(batch_size=batch)


def _nanogpt_without_flash() -> NanoGPTModule:
    """nanoGPT's other attention path, as the published code takes it where ``F.scaled_dot_product_attention`` is
    missing: explicit ``q @ k^T``, the registered causal ``bias`` buffer, ``masked_fill``, softmax, ``att @ v``."""
    module = NanoGPTModule()
    for block in module.model.transformer.h:
        attention = block.attn
        attention.flash = False
        size = module.model.config.block_size
        attention.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))
    return module


CASES = [  # (name, module factory, devices, dp, strategy arguments)
    ("nanogpt-tp2", NanoGPTModule, 2, 1, {"tensor_parallel_size": 2}),
    ("nanogpt-dp2-tp2-z1", NanoGPTModule, 4, 2, {"tensor_parallel_size": 2, "zero_stage": 1}),
    ("nanogpt-tp2-sp", NanoGPTModule, 2, 1, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    (
        "nanogpt-dp2-tp2-z1-sp",
        NanoGPTModule,
        4,
        2,
        {"tensor_parallel_size": 2, "zero_stage": 1, "sequence_parallel": True},
    ),
    ("nanogpt-tp2-loss-parallel", NanoGPTModule, 2, 1, {"tensor_parallel_size": 2, "loss_parallel": True}),
    ("nanogpt-without-flash-tp2", _nanogpt_without_flash, 2, 1, {"tensor_parallel_size": 2}),
    ("nanogpt-tp4", NanoGPTModule, 4, 1, {"tensor_parallel_size": 4}),
    ("nanogpt-tp2-checkpointing", NanoGPTModule, 2, 1, {"tensor_parallel_size": 2, "activation_checkpointing": True}),
    (
        "nanogpt-tp2-selective-checkpointing",
        NanoGPTModule,
        2,
        1,
        {"tensor_parallel_size": 2, "activation_checkpointing": "selective"},
    ),
    ("nanogpt-pp2-tp2", NanoGPTModule, 4, 1, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    ("litgpt-tp2", LitGPTModule, 2, 1, {"tensor_parallel_size": 2}),
    (
        "litgpt-dp2-tp2-z1-sp",
        LitGPTModule,
        4,
        2,
        {"tensor_parallel_size": 2, "zero_stage": 1, "sequence_parallel": True},
    ),
]


# The quick tier: both published models, both attention paths, dp x tp with sequence parallelism, and a pipeline.
QUICK_CASES = {"nanogpt-dp2-tp2-z1-sp", "nanogpt-without-flash-tp2", "nanogpt-pp2-tp2", "litgpt-tp2"}


@pytest.mark.parametrize(
    ("name", "factory", "devices", "dp", "strategy"),
    [case(*layout, id=layout[0], slow=layout[0] not in QUICK_CASES) for layout in CASES],
)
def test_global_shape_code_trains_like_one_process(name, factory, devices, dp, strategy):
    trained, _ = result((_trained() if name in QUICK_CASES else _slow_trained())[name])
    assert_same_training(result(_references()[_REFERENCE_OF[factory]]), trained, weight_atol=TP_WEIGHT_ATOL)


def _spawned_checks():
    """Every check of this file that needs a tp 2 group, in one job: each on the same mesh, one after the other,
    a failure kept as its traceback for its own test to report."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    checks = {
        "nanogpt": partial(_step, mesh, NanoGPTModule, False),
        "litgpt": partial(_step, mesh, LitGPTModule, False),
        "nanogpt-sp": partial(_step, mesh, NanoGPTModule, True),
        "fused-grouped-query": partial(_fused_grouped_query, mesh),
        "region-ops": partial(_region_ops, mesh),
        "nested": partial(_nested, mesh),
    }
    return run_each(checks)


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_spawned_checks, 2)[0]


def _ran(spawned, name):
    """A check's result from the shared job; its own test fails with the traceback if it raised there."""
    result = spawned[name]
    if (failed := traceback_of(result)) is not None:
        pytest.fail(f"{name} raised in the tp 2 job:\n{failed}")
    return result


def _step(mesh, factory, sequence_parallel):
    """One forward/backward of the sharded model against the unsharded one: collectives, loss and gradients."""
    import copy

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel
    from lightning_mgpu.parallel.tensor.sharding import tensor_parallel_context

    torch.manual_seed(0)
    reference = factory()
    module = copy.deepcopy(reference)
    apply_tensor_parallel(module, mesh, "auto", sequence_parallel)
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_of(model):
        out = model.model(x, y)[1] if isinstance(model, NanoGPTModule) else None
        if out is None:
            logits = model.model(x)
            out = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        return out

    reference_loss = loss_of(reference)
    reference_loss.backward()
    with tensor_parallel_context(sequence_parallel):
        with CommDebugMode() as forward:
            loss = loss_of(module)
        with CommDebugMode() as backward:
            loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in module.named_parameters()}
    result = {
        "fwd": {str(op).split(".")[-1]: n for op, n in forward.get_comm_counts().items()},
        "bwd": {str(op).split(".")[-1]: n for op, n in backward.get_comm_counts().items()},
        "loss_error": abs(float(loss) - float(reference_loss)) / float(reference_loss),
        "grad_error": max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters()),
    }
    return result


def test_collectives_per_step_are_the_local_paths(spawned):
    """Per block without SP: 2 all-reduces forward, 2 backward, as with plain shards, and the one small gather of
    the fused q|k|v bias gradient (which stays replicated so that FSDP can shard it) that the local path has too;
    no gather of activations. The head is tied to the embedding and replicated, so nothing outside the blocks."""
    layers = 4
    result = _ran(spawned, "nanogpt")
    assert result["fwd"] == {"all_reduce": 2 * layers}, result
    assert result["bwd"] == {"all_reduce": 2 * layers, "all_gather_into_tensor": layers}, result
    assert result["loss_error"] < 1e-6 and result["grad_error"] < 1e-6, result
    # litgpt: no biases, so nothing but the 2 + 2 all-reduces per block.
    litgpt = _ran(spawned, "litgpt")
    assert litgpt["fwd"] == {"all_reduce": 4} and litgpt["bwd"] == {"all_reduce": 4}, litgpt
    assert litgpt["loss_error"] < 1e-6 and litgpt["grad_error"] < 1e-6, litgpt


def test_collectives_with_sequence_parallel(spawned):
    """Each all-reduce of the stream becomes a reduce-scatter and an all-gather; the token embedding scatters and the
    vocabulary-sharded head (tied to it) gathers its input and its logits; replicated norm weights and biases used
    on sequence shards get their partial gradients all-reduced once (2 norms x (weight, bias) per block, plus
    ln_f's 2 and the position embedding), and the fused q|k|v bias gradient is gathered as without SP."""
    layers = 4
    result = _ran(spawned, "nanogpt-sp")
    assert result["fwd"] == {"all_gather_into_tensor": 2 * layers + 2, "reduce_scatter_tensor": 2 * layers + 1}, result
    assert result["bwd"] == {
        "all_gather_into_tensor": 3 * layers + 1,
        "reduce_scatter_tensor": 2 * layers + 1,
        "all_reduce": 4 * layers + 3,
    }, result
    assert result["loss_error"] < 1e-6 and result["grad_error"] < 1e-6, result


def _fused_grouped_query(mesh):
    """tp_plan="auto" keeps a fused grouped-query attention whole (with a warning); an explicit 'colwise_qkv' on it
    is refused with the grouped-query reason, before any size check that divides its width by three."""
    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = LitGPTModule(n_query_groups=2)
        apply_tensor_parallel(module, mesh, "auto", False)
    qkv = module.model.transformer.h[0].attn.qkv.weight
    explicit = {"model.transformer.h.*.attn.qkv": "colwise_qkv", "model.transformer.h.*.attn.proj": "rowwise"}
    try:
        apply_tensor_parallel(LitGPTModule(n_query_groups=2), mesh, explicit, False)
    except ValueError as error:
        refusal = str(error)
    else:
        refusal = "no error"
    whole = not isinstance(qkv, DTensor) or all(p.is_replicate() for p in qkv.placements)
    return {"warnings": [str(w.message) for w in caught], "qkv whole": whole, "refusal": refusal}


def test_fused_grouped_query_attention_is_kept_whole_by_auto_and_refused_when_sharded(spawned):
    outcome = _ran(spawned, "fused-grouped-query")
    assert outcome["qkv whole"]
    assert any("kept whole (replicated)" in w for w in outcome["warnings"]), outcome["warnings"]
    message = outcome["refusal"]
    assert re.search(
        r"model.transformer.h.0.attn.qkv fuses q, k and v of grouped-query attention \(4 query heads, 2"
        r" key/value heads",
        message,
    ), message
    assert "output features per q/k/v" not in message
    assert "{'model.transformer.h.*.attn.qkv': 'replicate', 'model.transformer.h.*.attn.proj': 'replicate'}" in message


_LITGPT_GQA = partial(LitGPTModule, n_query_groups=2)
_GQA_KEPT_WHOLE = {  # the way out the fused grouped-query error names: attention replicated, MLP sharded
    "model.transformer.h.*.attn.qkv": "replicate",
    "model.transformer.h.*.attn.proj": "replicate",
    "model.transformer.h.*.mlp.fc_1": "colwise",
    "model.transformer.h.*.mlp.fc_2": "colwise",
    "model.transformer.h.*.mlp.proj": "rowwise",
}


def test_fused_grouped_query_attention_kept_whole_trains_like_one_process():
    """The way out the error names: attention replicated, MLP sharded (with global shapes too)."""
    trained, _ = result(_trained()["litgpt-gqa-kept-whole-tp2"])
    assert_same_training(result(_references()["litgpt-gqa"]), trained, weight_atol=TP_WEIGHT_ATOL)


# ------------------------------------------------------------------------------- the fits, one job per world size
_REFERENCE_OF = {NanoGPTModule: "nanogpt", _nanogpt_without_flash: "nanogpt-without-flash", LitGPTModule: "litgpt"}


@functools.cache
def _references():
    """Every model's one-process run, in one job."""
    factories = {name: factory for factory, name in _REFERENCE_OF.items()}
    runs = {name: Run(factory, lambda: _tokens(GLOBAL_BATCH)) for name, factory in factories.items()}
    runs["litgpt-gqa"] = Run(_LITGPT_GQA, lambda: _tokens(GLOBAL_BATCH))
    return references(runs)


def _case_runs(names: set[str]) -> dict[int, dict[str, Run]]:
    """The layouts' runs named in ``names``, by world size."""
    by_devices: dict[int, dict[str, Run]] = {2: {}, 4: {}}
    for name, factory, devices, dp, strategy in CASES:
        if name in names:
            by_devices[devices][name] = Run(factory, lambda b=GLOBAL_BATCH // dp: _tokens(b), strategy)
    return by_devices


@functools.cache
def _slow_trained():
    """The slow tier's layouts: the runs of one world size one after the other in one job."""
    by_devices = _case_runs({case[0] for case in CASES} - QUICK_CASES)
    return {name: r for devices, runs in by_devices.items() for name, r in fit_each(runs, devices, 1200).items()}


@functools.cache
def _trained():
    """The quick tier's layouts and the kept-whole GQA run: the runs of one world size one after the other in one
    job."""
    by_devices = _case_runs(QUICK_CASES)
    by_devices[2]["litgpt-gqa-kept-whole-tp2"] = Run(
        _LITGPT_GQA, lambda: _tokens(GLOBAL_BATCH), {"tensor_parallel_size": 2, "tp_plan": _GQA_KEPT_WHOLE}
    )
    return {name: r for devices, runs in by_devices.items() for name, r in fit_each(runs, devices, 1200).items()}


def _region_ops(mesh):
    """The region's own operations on a DTensor, against the same operations on the full tensors."""
    import warnings

    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_mgpu.parallel.tensor.region import GlobalShapeMode

    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(2, 8, 3 * 16, generator=generator)  # [q | k | v], 4 heads of 4
    mask = torch.randn(1, 4, 8, 8, generator=generator)  # a bias per head: cut to the local heads
    sharded = distribute_tensor(fused, mesh, [_StridedShard(2, split_factor=3)])
    results = {}
    with CommDebugMode() as comm, GlobalShapeMode():
        q, k, v = sharded.split(16, dim=2)
        chunks = sharded.chunk(3, dim=-1)
        sizes = torch.split(sharded, [16, 16, 16], dim=2)
        heads = [t.view(2, 8, 4, 4).transpose(1, 2) for t in (q, k, v)]
        attention = torch.nn.functional.scaled_dot_product_attention(*heads, attn_mask=mask)
        merged = attention.transpose(1, 2).contiguous().view(2, 8, 16)
        shifted = merged + torch.arange(16.0)  # a plain tensor enters as replicated
    results["local_comm"] = sum(comm.get_comm_counts().values())
    results["placements"] = {str(t.placements) for t in (q, k, v, *chunks, *sizes, merged, shifted)}
    full_heads = [t.view(2, 8, 4, 4).transpose(1, 2) for t in fused.split(16, dim=2)]
    expected = torch.nn.functional.scaled_dot_product_attention(*full_heads, attn_mask=mask)
    expected = expected.transpose(1, 2).reshape(2, 8, 16) + torch.arange(16.0)
    results["error"] = float((shifted.full_tensor() - expected).abs().max())
    with warnings.catch_warnings(record=True) as caught, GlobalShapeMode():
        warnings.simplefilter("always")
        uneven = sharded.split([32, 8, 8], dim=2)  # not the three equal chunks it is sharded as: DTensor gathers
    results["uneven_error"] = max(
        float((part.full_tensor() - ref).abs().max()) for part, ref in zip(uneven, fused.split([32, 8, 8], dim=2))
    )
    results["warning"] = str(caught[0].message) if caught else ""
    return results


def test_region_splits_fused_outputs_and_runs_attention_without_communication(spawned):
    results = _ran(spawned, "region-ops")
    assert results["local_comm"] == 0, results
    assert results["placements"] == {"(Shard(dim=2),)"}, results
    assert results["error"] < 1e-6, results
    assert results["uneven_error"] == 0.0, results
    assert "split into [32, 8, 8]" in results["warning"] and "all-gather" in results["warning"], results


class _FusedProjection(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(width, 3 * width)

    def forward(self, x):
        return self.c_attn(x)


class _NestedAttention(torch.nn.Module):
    """nanoGPT's attention with its fused projection one module further down (``attn.inner.c_attn``)."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.inner = _FusedProjection(width)
        self.c_proj = torch.nn.Linear(width, width)
        self.n_head, self.n_embd = heads, width

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.inner(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _nested(mesh):
    import copy

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel

    torch.manual_seed(0)
    reference = torch.nn.ModuleDict({"h": torch.nn.ModuleList([_NestedAttention(), _NestedAttention()])})
    module = copy.deepcopy(reference)
    apply_tensor_parallel(module, mesh, {"h.*.inner.c_attn": "colwise_qkv", "h.*.c_proj": "rowwise"}, False)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))

    def run(model):
        out = x
        for block in model["h"]:
            out = out + block(out)
        return out

    expected = run(reference)
    expected.square().mean().backward()
    with CommDebugMode() as comm:
        out = run(module)
        out.square().mean().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in module.named_parameters()}
    return {
        "comm": {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()},
        "error": float((out - expected).abs().max()),
        "grad_error": max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters()),
    }


def test_a_projection_nested_deeper_shares_the_region_of_its_row_parallel_partner(spawned):
    """The region is the nearest ancestor holding the row-parallel projection too (here ``attn``, not ``inner``),
    so the fused output is split and reshaped with global shapes where the author wrote it."""
    result = _ran(spawned, "nested")
    assert result["error"] < 1e-6 and result["grad_error"] < 1e-6, result
    # 2 blocks: an all-reduce forward and the fused-bias gather each; in backward the second block's input gradient
    # (x itself needs none).
    assert result["comm"] == {"all_reduce": 3, "all_gather_into_tensor": 2}, result


def test_auto_picks_plain_shards_only_for_hugging_face_plans():
    """Which modules run with global shapes is read from the model's structure, before training."""
    from lightning_mgpu.parallel.tensor.plan import _match, auto_plan
    from lightning_mgpu.parallel.tensor.sharding import _global_shape_regions
    from tests.helpers.modules import GPT2Module, LlamaModule

    def regions(module):
        return set(_global_shape_regions(module, _match(module, auto_plan(module))).values())

    blocks = {f"model.transformer.h.{i}.{part}" for i in range(4) for part in ("attn", "mlp")}
    assert regions(NanoGPTModule()) == blocks
    assert regions(LitGPTModule()) == {f"model.transformer.h.{i}.{part}" for i in range(2) for part in ("attn", "mlp")}
    assert regions(GPT2Module()) == {f"model.transformer.h.{i}.{part}" for i in range(2) for part in ("attn", "mlp")}
    assert regions(LlamaModule()) == set()  # Hugging Face's plan: its modules are written for plain shards
