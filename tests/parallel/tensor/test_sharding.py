"""Tensor (+ sequence) parallelism on unmodified modules, alone and composed with ZeRO over data parallel."""

from __future__ import annotations

import functools
from functools import partial

import lightning as L
import pytest
import torch

from lightning_mgpu import HybridStrategy
from lightning_mgpu.demo import GPTLightningModule, TextDataModule
from lightning_mgpu.parallel.tensor.plan import auto_plan
from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.distributed import run_distributed, run_each, traceback_of
from tests.helpers.equivalence import assert_same_training
from tests.helpers.modules import GPT2Module, LlamaModule, RandomTokenDataModule
from tests.helpers.tiers import case

GLOBAL_BATCH = 8
STEPS = 10
# Losses are held to 1e-5 relative. Weights after 10 AdamW steps to 1e-4 absolute: sharded matmuls sum in another
# order, and Adam's m/(sqrt(v)+eps) turns ~1e-9 gradient differences on near-zero gradients into ~1e-5 steps.
TP_WEIGHT_ATOL = 1e-4


def _nanogpt():
    return GPTLightningModule(block_size=32, n_layer=2, n_head=4, n_embd=32, lr=1e-3)


def _models(tp: int) -> dict:
    # GQA Llama (2 KV heads) for tp=2; tp=4 needs 4 KV heads.
    llama = partial(LlamaModule, num_key_value_heads=2 if tp == 2 else 4)
    tokens = lambda batch: RandomTokenDataModule(batch_size=batch)
    return {
        "llama": (llama, tokens),
        "gpt2": (GPT2Module, tokens),
        "nanogpt": (_nanogpt, lambda batch: TextDataModule(batch_size=batch, block_size=32)),
    }


def _reference(model: str, tp: int):
    name = f"{model}-tp{tp}"
    return result((_references() if name in _references() else _slow_references())[name])


LAYOUTS = [  # (devices, dp, tp, zero_stage)
    (2, 1, 2, 0),
    (4, 1, 4, 0),
    (4, 2, 2, 0),
    (4, 2, 2, 1),
    (4, 2, 2, 3),
]


def _matrix_name(model, dp, tp, zero_stage, sequence_parallel):
    return f"{model}-dp{dp}-tp{tp}-z{zero_stage}{'-sp' if sequence_parallel else ''}"


MATRIX = [  # every model under every layout, with and without sequence parallelism: 30 fits
    (model, devices, dp, tp, zero_stage, sp)
    for model in ("llama", "gpt2", "nanogpt")
    for devices, dp, tp, zero_stage in LAYOUTS
    for sp in (False, True)
]
# The quick tier trains every model and every layout at least once, with sequence parallelism at tp 2 and tp 4 (5
# fits); the slow tier the rest.
QUICK_MATRIX = {
    "llama-dp2-tp2-z0",
    "llama-dp2-tp2-z1-sp",
    "gpt2-dp2-tp2-z3",
    "nanogpt-dp1-tp2-z0",
    "nanogpt-dp1-tp4-z0-sp",
}
SLOW_MATRIX = {_matrix_name(m, dp, tp, z, sp) for m, _, dp, tp, z, sp in MATRIX} - QUICK_MATRIX


def _param(model, devices, dp, tp, zero_stage, sp):
    test_id = f"{model}-dp{dp}-tp{tp}-z{zero_stage}-{'tp+sp' if sp else 'tp'}"
    slow = _matrix_name(model, dp, tp, zero_stage, sp) in SLOW_MATRIX
    return case(model, devices, dp, tp, zero_stage, sp, id=test_id, slow=slow)


@pytest.mark.parametrize(
    ("model", "devices", "dp", "tp", "zero_stage", "sequence_parallel"),
    [_param(*case) for case in MATRIX],
)
def test_tensor_parallel_trains_like_one_process(model, devices, dp, tp, zero_stage, sequence_parallel):
    name = _matrix_name(model, dp, tp, zero_stage, sequence_parallel)
    trained, _ = result((_slow_trained() if name in SLOW_MATRIX else _trained())[name])
    assert_same_training(_reference(model, tp), trained, weight_atol=TP_WEIGHT_ATOL)


def test_explicit_dict_plan_and_gradient_clipping():
    plan = {
        "model.transformer.h.*.attn.c_attn": "colwise_qkv",
        "model.transformer.h.*.attn.c_proj": "rowwise",
        "model.transformer.h.*.mlp.c_fc": "colwise",
        "model.transformer.h.*.mlp.c_proj": "rowwise",
        "model.lm_head": "colwise_gather_output",
    }
    assert _trained_runs()[4]["nanogpt-explicit-plan-clip"].strategy_kwargs["tp_plan"] == plan
    trained, _ = result(_trained()["nanogpt-explicit-plan-clip"])
    assert_same_training(result(_references()["nanogpt-clip"]), trained, weight_atol=TP_WEIGHT_ATOL)


_EXPLICIT_PLAN = {
    "model.transformer.h.*.attn.c_attn": "colwise_qkv",
    "model.transformer.h.*.attn.c_proj": "rowwise",
    "model.transformer.h.*.mlp.c_fc": "colwise",
    "model.transformer.h.*.mlp.c_proj": "rowwise",
    "model.lm_head": "colwise_gather_output",
}
_CLIP = {"gradient_clip_val": 0.05}


class _HandParallelGPT(GPTLightningModule):
    """Lightning ModelParallelStrategy style: the user shards in configure_model with self.device_mesh."""

    def configure_model(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tp"]
        for block in self.model.transformer.h:
            parallelize_module(block.mlp, tp_mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})


def _hand_parallel_gpt():
    return _HandParallelGPT(block_size=32, n_layer=2, n_head=4, n_embd=32, lr=1e-3)


def test_user_configure_model_with_device_mesh_keeps_working():
    trained, _ = result(_trained()["nanogpt-hand-parallel-tp2"])
    assert_same_training(_reference("nanogpt", 2), trained, weight_atol=TP_WEIGHT_ATOL)


def test_auto_plans():
    gpt = auto_plan(_nanogpt())
    assert gpt == {
        "model.transformer.h.*.attn.c_attn": "colwise_qkv",
        "model.transformer.h.*.attn.c_proj": "rowwise",
        "model.transformer.h.*.mlp.c_fc": "colwise",
        "model.transformer.h.*.mlp.c_proj": "rowwise",
    }
    llama = auto_plan(LlamaModule())
    assert llama["model.lm_head"] == "colwise_gather_output"
    assert llama["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert llama["model.model.layers.*.mlp.down_proj"] == "rowwise"
    gpt2 = auto_plan(GPT2Module())
    assert gpt2["model.transformer.h.*.attn.c_attn"] == "colwise_qkv"  # Conv1D, fused q|k|v
    sp = auto_plan(_nanogpt(), sequence_parallel=True)
    assert (
        sp["model.transformer.h.0.ln_1"] == "sequence_parallel" and sp["model.transformer.ln_f"] == "sequence_parallel"
    )
    assert sp["model.transformer.wte"] == "embedding_rowwise" and sp["model.lm_head"] == "colwise_gather_output"


class _UnknownLayers(GPTLightningModule):
    def __init__(self):
        super().__init__(block_size=32, n_layer=2, n_head=4, n_embd=32)
        for block in self.model.transformer.h:
            block.mlp.mystery = torch.nn.Linear(32, 32)


def test_auto_plan_names_layers_it_cannot_place():
    with pytest.raises(
        ValueError, match=r"cannot tell how to shard.*transformer.h.0.mlp.mystery.*Pass `tp_plan` as a dict"
    ):
        auto_plan(_UnknownLayers())


def _apply_worker(cases, tp, loss_parallel=False):
    """Each ``(module_factory, plan)``'s error on one tp mesh."""
    torch.distributed.init_process_group("gloo")
    return _apply(cases, tp, loss_parallel)


def _apply(cases, tp, loss_parallel=False):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    errors = []
    for module_factory, plan in cases:
        try:
            apply_tensor_parallel(module_factory(), mesh, plan, sequence_parallel=False, loss_parallel=loss_parallel)
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
    return errors


MISCONFIGURATIONS = [  # (module factory, plan, the error's pattern) on a tp=4 mesh
    (
        partial(LlamaModule, num_key_value_heads=2),
        "auto",
        r"tensor_parallel_size=4 must divide.*config.num_key_value_heads = 2",
    ),
    (
        _nanogpt,
        {"model.transformer.h.*.attn.nope": "colwise"},
        r"`tp_plan` entry 'model.transformer.h.\*.attn.nope' matches no module",
    ),
    (
        lambda: GPTLightningModule(block_size=32, n_layer=1, n_head=2, n_embd=34),
        "auto",
        r"attn.c_attn: 34 output features per q/k/v.*attn.n_head = 2",
    ),
]


@functools.cache
def _misconfigured():
    """Every misconfiguration's error, in one job."""
    return run_distributed(_apply_worker, 4, [case[:2] for case in MISCONFIGURATIONS], 4, timeout=120)[0]


@pytest.mark.parametrize("case", range(len(MISCONFIGURATIONS)), ids=["kv-heads", "no-module", "qkv-features"])
def test_misconfigurations_fail_before_training_with_the_numbers(case):
    import re

    message = _misconfigured()[case]
    assert re.search(MISCONFIGURATIONS[case][2], message), message


def test_unknown_style_fails_at_construction():
    with pytest.raises(ValueError, match=r"unknown styles.*'diagonal'"):
        HybridStrategy(tensor_parallel_size=2, tp_plan={"model.*": "diagonal"})


def _comm_counts(sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_mgpu.parallel.tensor.sharding import tensor_parallel_context

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    module = GPTLightningModule(block_size=16, n_layer=3, n_head=4, n_embd=32)
    apply_tensor_parallel(module, mesh, "auto", sequence_parallel)
    tokens = torch.randint(0, 256, (2, 17))
    with CommDebugMode() as comm, tensor_parallel_context(sequence_parallel):
        logits = module(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


def test_collectives_per_step_match_the_analytic_count():
    layers = 3
    counts, sp = _probe("comm-counts")[0]
    # Megatron's f/g: per block an all-reduce after attention and after the MLP in forward, and one for the input
    # gradient of each column-parallel region (qkv, fc) in backward; plus one small all-gather per block of the
    # fused q|k|v bias gradient (3 * n_embd / tp floats), which stays replicated so FSDP can shard it.
    assert counts == {"all_reduce": 4 * layers, "all_gather_into_tensor": layers}, counts
    # Sequence parallel turns each all-reduce into reduce-scatter + all-gather: per block 2 AG + 2 RS forward and
    # the mirror image backward, plus the fused-bias gather; outside the blocks the token embedding scatters (RS
    # forward, AG backward) and the head gathers its input (AG forward, RS backward) and its logits (AG forward).
    # Replicated parameters used on sequence shards get partial gradients, all-reduced once right after backward:
    # per block 2 norms x (weight, bias), plus the final norm's 2 and the position embedding.
    assert sp == {
        "all_gather_into_tensor": 5 * layers + 3,
        "reduce_scatter_tensor": 4 * layers + 2,
        "all_reduce": 4 * layers + 3,
    }, sp
    print("tp=2 collectives per step:", counts, "with sequence parallel:", sp)


class _LlamaWithHuggingFaceLoss(LlamaModule):
    """The loss computed inside the Hugging Face model (`labels=`: shift, ignore_index, mean), not by the user."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss


class _LlamaManualOptimization(LlamaModule):
    """`manual_backward` inside the step: the loss-parallel context is entered again, nested."""

    def __init__(self):
        super().__init__(num_key_value_heads=2)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(input_ids=x).logits.reshape(-1, 128), y.reshape(-1))
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss, sync_dist=True)


def _tied_gpt2():
    return GPT2Module(tie_word_embeddings=True)


_tokens = lambda batch: RandomTokenDataModule(batch_size=batch)
_text = lambda batch: TextDataModule(batch_size=batch, block_size=32)
LOSS_PARALLEL = [  # (name, module, data, devices, dp, extra strategy arguments)
    ("nanogpt-tp2", _nanogpt, _text, 2, 1, {}),
    ("nanogpt-dp2-tp2-z1-sp", _nanogpt, _text, 4, 2, {"zero_stage": 1, "sequence_parallel": True}),
    ("llama-hf-loss-tp2", _LlamaWithHuggingFaceLoss, _tokens, 2, 1, {}),
    ("llama-hf-loss-tp2-sp", _LlamaWithHuggingFaceLoss, _tokens, 2, 1, {"sequence_parallel": True}),
    ("llama-manual-optimization-tp2", _LlamaManualOptimization, _tokens, 2, 1, {}),
    ("gpt2-tied-tp2", _tied_gpt2, _tokens, 2, 1, {}),
    ("nanogpt-pp2-tp2", _nanogpt, _text, 4, 1, {"pipeline_parallel_size": 2}),
]


# The slow tier: loss parallelism without sequence parallelism on two more models (the quick tier trains it on three).
SLOW_LOSS_PARALLEL = {"nanogpt-tp2", "llama-hf-loss-tp2"}


@pytest.mark.parametrize(
    ("name", "module", "data", "devices", "dp", "extra"),
    [
        case(*loss_parallel, id=loss_parallel[0], slow=loss_parallel[0] in SLOW_LOSS_PARALLEL)
        for loss_parallel in LOSS_PARALLEL
    ],
)
def test_loss_parallel_trains_like_one_process(name, module, data, devices, dp, extra):
    # nanoGPT: the same single-process run as the tests above
    reference = result(_references()["nanogpt-tp2" if module is _nanogpt else name])
    trained, extras = result((_slow_trained() if name in SLOW_LOSS_PARALLEL else _trained())[name])
    assert_same_training(reference, trained, weight_atol=TP_WEIGHT_ATOL)
    last_stage = extras[-1]  # with pipelining the head lives on the last stage
    assert "Shard(dim=0)" in last_stage["head_placements"]  # sharded over the vocabulary
    if name.startswith("gpt2-tied"):
        assert last_stage["head_tied"]
    if "pipeline_parallel_size" not in extra:
        # Outside the steps (predict_step, generate() in a callback) the head hands back whole, plain logits.
        assert last_stage["outside_step_logits"] == ("Tensor", 128 if "nanogpt" not in name else 256), last_stage


class _HeadLayout(L.Callback):
    def on_train_start(self, trainer, pl_module):
        head = getattr(pl_module.model.lm_head, "weight", None)  # None on a pipeline stage without the head
        embedding = pl_module.model.get_input_embeddings() if hasattr(pl_module.model, "get_input_embeddings") else None
        self.results = {
            "head_placements": str(getattr(head, "placements", "plain")),
            "head_tied": embedding is not None and embedding.weight is head,
        }

    def on_train_end(self, trainer, pl_module):
        if trainer.strategy.layout.pipeline_parallel_size > 1:
            return
        from torch.distributed.tensor.experimental import implicit_replication

        # Through the strategy's root module (so data-parallel hooks run) but outside any step; sequence
        # parallelism needs implicit replication there, as it always has.
        with torch.no_grad(), implicit_replication():
            logits = trainer.strategy.model("forward", torch.zeros(2, 8, dtype=torch.long))
        self.results["outside_step_logits"] = (type(logits).__name__, logits.shape[-1])


def test_loss_parallel_needs_tensor_parallelism():
    with pytest.raises(ValueError, match=r"loss_parallel=True.*tensor_parallel_size > 1"):
        HybridStrategy(loss_parallel=True)


_HEAD_REPLICATED = {
    "model.transformer.h.*.attn.c_attn": "colwise_qkv",
    "model.transformer.h.*.attn.c_proj": "rowwise",
    "model.lm_head": "replicate",
}


def test_loss_parallel_without_a_head_to_shard_fails_before_training():
    message = _probe("loss-parallel-without-head")[0][0]
    assert "`loss_parallel=True` needs the LM head sharded over the vocabulary" in message, message
    assert "'colwise_loss_parallel'" in message, message


def _loss_parallel_comm(loss_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_mgpu.parallel.tensor.sharding import tensor_parallel_context

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    module = GPTLightningModule(block_size=16, n_layer=3, n_head=4, n_embd=32)
    plan = {
        "model.transformer.h.*.attn.c_attn": "colwise_qkv",
        "model.transformer.h.*.attn.c_proj": "rowwise",
        "model.transformer.h.*.mlp.c_fc": "colwise",
        "model.transformer.h.*.mlp.c_proj": "rowwise",
        "model.lm_head": "colwise_gather_output",
    }
    apply_tensor_parallel(module, mesh, plan, False, loss_parallel=loss_parallel)
    tokens = torch.randint(0, 256, (2, 17))
    with CommDebugMode() as comm, tensor_parallel_context(False, loss_parallel):
        logits = module(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return counts, type(loss).__name__, float(loss)


def test_loss_parallel_never_gathers_the_logits():
    layers = 3
    probes = _probe("loss-parallel-comm")[0]
    (gathered, _, loss_gathered), (parallel, loss_type, loss_parallel) = probes
    # Gathered logits: per block 4 all-reduces and the fused-bias gather, plus the head's all-gather of the
    # b x s x V logits in forward and the all-reduce of its input gradient in backward.
    assert gathered == {"all_reduce": 4 * layers + 1, "all_gather_into_tensor": layers + 1}, gathered
    # Vocabulary-parallel loss: no gather of the logits; the cross-entropy all-reduces b x s numbers instead (the
    # row max, the sum of exponentials and the target logit).
    assert parallel == {"all_reduce": 4 * layers + 1 + 3, "all_gather_into_tensor": layers}, parallel
    assert loss_type == "Tensor"  # handed back as a plain tensor for Lightning
    assert abs(loss_parallel - loss_gathered) <= 1e-6 * abs(loss_gathered)


def _tied_plan(plan):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    module = GPT2Module(tie_word_embeddings=True)
    try:
        apply_tensor_parallel(module, mesh, plan, False)
    except ValueError as error:
        return str(error)
    return module.model.lm_head.weight is module.model.transformer.wte.weight


_BLOCKS = {"model.transformer.h.*.attn.c_attn": "colwise_qkv", "model.transformer.h.*.attn.c_proj": "rowwise"}
_TIED_PLANS = [  # the tied head and embedding sharded alike; the head alone
    {**_BLOCKS, "model.lm_head": "colwise_gather_output", "model.transformer.wte": "embedding_rowwise"},
    {**_BLOCKS, "model.lm_head": "colwise_gather_output"},
]


def test_tied_weights_stay_tied_or_fail_naming_both():
    (tied, message), (tied_on_rank1, _) = _probe("tied-plans")
    assert tied is True and tied_on_rank1 is True
    assert "model.transformer.wte.weight and model.lm_head.weight are one tied weight" in message, message


def _llama_collectives():
    """HF Llama tp=2, its own `labels=` loss: collectives per phase and loss/gradients against the unsharded model,
    with and without sequence parallelism and loss parallelism (one process group, four shardings)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_mgpu.parallel.tensor.sharding import tensor_parallel_context

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    tokens[:, :3] = -100  # ignored positions: ignore_index must hold on the shards too
    inputs = tokens.clamp(min=0)
    reference = LlamaModule(num_key_value_heads=2, seed=0)
    reference_loss = reference.model(input_ids=inputs, labels=tokens).loss
    reference_loss.backward()
    results = {}
    for sp in (False, True):
        for lp in (False, True):
            module = LlamaModule(num_key_value_heads=2, seed=0)
            apply_tensor_parallel(module, mesh, "auto", sp, loss_parallel=lp)
            with tensor_parallel_context(sp, lp):
                with CommDebugMode() as forward:
                    loss = module.model(input_ids=inputs, labels=tokens).loss
                with CommDebugMode() as backward:
                    loss.backward()
            grads = {
                name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                for name, p in module.named_parameters()
            }
            results[(sp, lp)] = {
                "fwd": {str(op).split(".")[-1]: n for op, n in forward.get_comm_counts().items()},
                "bwd": {str(op).split(".")[-1]: n for op, n in backward.get_comm_counts().items()},
                "loss_type": type(loss).__name__,
                "loss_error": abs(float(loss) - float(reference_loss)) / float(reference_loss),
                "grad_error": max(
                    float((grads[name] - p.grad).abs().max()) for name, p in reference.named_parameters()
                ),
            }
    return results


def test_llama_collectives_per_step_and_loss_parallel_match_the_analytic_count():
    """Hugging Face's plan shards q/k/v and gate/up column-wise, each reading the same input: converted once per
    attention/MLP, backward needs one collective per module, not one per projection (5 per block)."""
    L = 2  # layers of the tiny Llama
    results = _probe("llama-collectives")[0]
    # Without SP, per block: forward all-reduces the attention and MLP outputs, backward their input gradients;
    # outside: the vocab-parallel embedding's output all-reduce (fwd) and the head's input gradient (bwd).
    # The head gathers the b x s x V logits (1 AG) unless loss_parallel, whose cross-entropy all-reduces three
    # b x s vectors instead (row max, sum of exponentials, target logit).
    assert results[(False, False)]["fwd"] == {"all_reduce": 2 * L + 1, "all_gather_into_tensor": 1}
    assert results[(False, False)]["bwd"] == {"all_reduce": 2 * L + 1}  # was 5 * L + 1 converted per projection
    assert results[(False, True)]["fwd"] == {"all_reduce": 2 * L + 1 + 3}
    assert results[(False, True)]["bwd"] == {"all_reduce": 2 * L + 1}
    # With SP each all-reduce of the stream becomes an all-gather before the column-parallel module and a
    # reduce-scatter after the row-parallel one, mirrored in backward; the embedding reduce-scatters, the head
    # gathers its input; the replicated RMSNorm weights' partial gradients are all-reduced (2 per block + final).
    assert results[(True, False)]["fwd"] == {"reduce_scatter_tensor": 2 * L + 1, "all_gather_into_tensor": 2 * L + 2}
    sp_backward = {"reduce_scatter_tensor": 2 * L + 1, "all_gather_into_tensor": 2 * L + 1, "all_reduce": 2 * L + 1}
    assert results[(True, False)]["bwd"] == sp_backward  # was 5 * L + 1 reduce-scatters, 5 * L + 2 gathers forward
    assert results[(True, True)]["fwd"] == {
        "reduce_scatter_tensor": 2 * L + 1,
        "all_gather_into_tensor": 2 * L + 1,
        "all_reduce": 3,
    }
    assert results[(True, True)]["bwd"] == sp_backward
    for key, probe in results.items():
        assert probe["loss_type"] == "Tensor", key  # Lightning gets a plain tensor, also under loss_parallel
        assert probe["loss_error"] < 1e-6 and probe["grad_error"] < 1e-6, (key, probe)


def test_loss_parallel_context_nests_and_survives_errors():
    """manual_backward inside a step enters the context again; an exception must not leave torch's handlers on."""
    from torch.distributed.tensor import DTensor

    from lightning_mgpu.parallel.tensor.sharding import tensor_parallel_context

    handlers = DTensor._op_dispatcher._custom_op_handlers
    log_softmax = torch.ops.aten._log_softmax.default
    with tensor_parallel_context(False, True):
        with tensor_parallel_context(False, True):
            assert log_softmax in handlers
        assert log_softmax in handlers  # still on for the rest of the outer step
    assert log_softmax not in handlers
    with pytest.raises(RuntimeError, match="boom"):
        with tensor_parallel_context(True, True):
            raise RuntimeError("boom")
    assert log_softmax not in handlers


def test_shared_input_skips_inference_tensors_and_grad_mode_changes():
    from lightning_mgpu.parallel.tensor.styles import _SharedInput

    shared = _SharedInput()
    shared.open()
    with torch.inference_mode():
        frozen = torch.ones(2)
        shared.keep(frozen, "converted")  # no version counter: must neither raise nor be kept
        assert not shared.hit(frozen)
    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        shared.keep(x, "converted without grad")
    assert not shared.hit(x)  # a grad-enabled sibling must convert anew
    shared.keep(x, "converted")
    assert shared.hit(x) and shared.converted == "converted"
    shared.close()
    assert not shared.hit(x)


# ----------------------------------------------------------------------------- the tp=2 probes, in one 2-rank job
_PROBES = {
    "comm-counts": lambda: [_comm_counts(sequence_parallel) for sequence_parallel in (False, True)],
    "loss-parallel-comm": lambda: [_loss_parallel_comm(loss_parallel) for loss_parallel in (False, True)],
    "loss-parallel-without-head": lambda: _apply([(_nanogpt, _HEAD_REPLICATED)], 2, loss_parallel=True),
    "tied-plans": lambda: [_tied_plan(plan) for plan in _TIED_PLANS],
    "llama-collectives": _llama_collectives,
}


def _probes_worker():
    """Every probe of this file that needs a tp=2 group, one after the other in one process group; a probe that
    raises is kept as its traceback, for its own test to report."""
    torch.distributed.init_process_group("gloo")
    return run_each(_PROBES)


@functools.cache
def _probes():
    return run_distributed(_probes_worker, 2, timeout=600)


def _probe(name):
    """Every rank's result of the probe ``name``; its test fails with the traceback if it raised."""
    results = [rank[name] for rank in _probes()]
    failed = next((failed for r in results if (failed := traceback_of(r)) is not None), None)
    if failed is not None:
        pytest.fail(f"{name} raised in the tp=2 probe job:\n{failed}")
    return results


# ------------------------------------------------------------------------------- the fits, one job per world size
def _matrix_references(names: set[str]) -> dict[str, Run]:
    """The one-process runs the matrix cases in ``names`` compare with."""
    runs = {}
    for model, _, dp, tp, zero_stage, sp in MATRIX:
        if _matrix_name(model, dp, tp, zero_stage, sp) in names:
            module, data = _models(tp)[model]
            runs[f"{model}-tp{tp}"] = Run(module, lambda d=data: d(GLOBAL_BATCH))
    return runs


@functools.cache
def _references():
    """The quick tier's one-process runs, in one job."""
    runs = _matrix_references(QUICK_MATRIX)
    runs["nanogpt-clip"] = Run(_nanogpt, lambda: TextDataModule(batch_size=8, block_size=32), trainer_kwargs=_CLIP)
    for name, module, data, _, _, _ in LOSS_PARALLEL:
        if module is not _nanogpt:
            runs[name] = Run(module, lambda d=data: d(GLOBAL_BATCH))
    return references(runs)


@functools.cache
def _slow_references():
    """The slow matrix's one-process runs (those the quick tier also ran are not run again)."""
    return references(_matrix_references(SLOW_MATRIX))


def _matrix_runs(names: set[str]) -> dict[int, dict[str, Run]]:
    """The matrix's runs named in ``names``, by world size."""
    by_devices: dict[int, dict[str, Run]] = {2: {}, 4: {}}
    for model, devices, dp, tp, zero_stage, sp in MATRIX:
        name = _matrix_name(model, dp, tp, zero_stage, sp)
        if name in names:
            module, data = _models(tp)[model]
            strategy = {"tensor_parallel_size": tp, "zero_stage": zero_stage, "sequence_parallel": sp}
            by_devices[devices][name] = Run(module, lambda d=data, b=GLOBAL_BATCH // dp: d(b), strategy)
    return by_devices


@functools.cache
def _trained_runs():
    """The quick tier's runs, by world size: its matrix cases and every other test's."""
    by_devices = _matrix_runs(QUICK_MATRIX)
    by_devices[4]["nanogpt-explicit-plan-clip"] = Run(
        _nanogpt,
        lambda: TextDataModule(batch_size=4, block_size=32),
        {"tensor_parallel_size": 2, "tp_plan": _EXPLICIT_PLAN, "zero_stage": 1},
        trainer_kwargs=_CLIP,
    )
    by_devices[2]["nanogpt-hand-parallel-tp2"] = Run(
        _hand_parallel_gpt, lambda: TextDataModule(batch_size=8, block_size=32), {"tensor_parallel_size": 2}
    )
    _add_loss_parallel_runs(by_devices, {case[0] for case in LOSS_PARALLEL} - SLOW_LOSS_PARALLEL)
    return by_devices


def _add_loss_parallel_runs(by_devices: dict[int, dict[str, Run]], names: set[str]) -> None:
    for name, module, data, devices, dp, extra in LOSS_PARALLEL:
        if name in names:
            by_devices[devices][name] = Run(
                module,
                lambda d=data, b=GLOBAL_BATCH // dp: d(b),
                {"tensor_parallel_size": 2, "loss_parallel": True, **extra},
                callbacks_factory=lambda: [_HeadLayout()],
            )


@functools.cache
def _trained():
    return {name: r for devices, runs in _trained_runs().items() for name, r in fit_each(runs, devices, 1800).items()}


@functools.cache
def _slow_trained():
    """The slow tier's matrix and loss-parallel cases."""
    by_devices = _matrix_runs(SLOW_MATRIX)
    _add_loss_parallel_runs(by_devices, SLOW_LOSS_PARALLEL)
    return {name: r for devices, runs in by_devices.items() for name, r in fit_each(runs, devices, 1800).items()}
