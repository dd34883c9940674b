"""Every style in the installed transformers' tensor-parallel vocabulary is mapped or refused by name, before training.

The vocabulary is read from transformers itself (its style registry and every model's plan), so a transformers
release with a new style fails here until that style is mapped or refused on purpose.
"""

from __future__ import annotations

import re

import pytest
import torch

from lightning_mgpu.parallel.tensor import apply_tensor_parallel
from lightning_mgpu.parallel.tensor_plan import _HF_REFUSED, _HF_STYLES, STYLE_NAMES, auto_plan
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import RandomTokenDataModule, _CausalLMModule

transformers = pytest.importorskip("transformers")

STEPS = 10
GLOBAL_BATCH = 8
TP_WEIGHT_ATOL = 1e-4  # as in test_tensor.py: AdamW on near-zero gradients

# transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES of transformers 5.23, and how each is served.
MAPPED = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "embedding_rowwise",
    "embedding_colwise": "embedding_colwise",
    "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
    "sequence_parallel": "sequence_parallel",
    "replicate": "replicate",
}
REFUSED = {"packed_colwise", "packed_rowwise", "moe_tp_experts", "moe_identity_expert", "grouped_gemm",
           "ep_dispatch_experts", "mla_kv_a_proj", "all_reduce", "local_params"}


def _registered_styles() -> set[str]:
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)
    import transformers.distributed.tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return set(ALL_PARALLEL_STYLES._global_mapping)


def _declared_plans() -> dict[str, dict[str, str]]:
    """``{model_type: base_model_tp_plan}`` for every configuration class (and sub-configuration) declaring one."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    plans: dict[str, dict[str, str]] = {}
    for model_type in list(CONFIG_MAPPING.keys()):
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception:  # a configuration needing an optional dependency
            continue
        classes = [config_class, *getattr(config_class, "sub_configs", {}).values()]
        for cls in classes:
            plan = getattr(cls, "base_model_tp_plan", None)
            if isinstance(plan, dict) and plan:
                plans[getattr(cls, "model_type", model_type) or model_type] = dict(plan)
    return plans


def test_every_registered_style_is_mapped_or_refused():
    registered = _registered_styles()
    assert registered == set(MAPPED) | REFUSED, (
        f"transformers' style registry changed: new {sorted(registered - set(MAPPED) - REFUSED)},"
        f" gone {sorted((set(MAPPED) | REFUSED) - registered)}: map or refuse them in tensor_plan.py"
    )
    assert _HF_STYLES == MAPPED and set(_HF_REFUSED) == REFUSED
    assert set(MAPPED.values()) <= set(STYLE_NAMES)


def test_every_style_in_every_model_plan_is_mapped_or_refused():
    plans = _declared_plans()
    assert len(plans) > 100, len(plans)
    used = {style for plan in plans.values() for style in plan.values()}
    assert used <= set(MAPPED) | REFUSED, f"plans use styles neither mapped nor refused: {used - set(MAPPED) - REFUSED}"
    served = sorted(t for t, plan in plans.items() if set(plan.values()) <= set(MAPPED))
    refused = sorted(t for t, plan in plans.items() if not set(plan.values()) <= set(MAPPED))
    # The split as of transformers 5.23 (printed on failure, so a new release's changes are visible).
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"} <= set(served), served
    assert {"mixtral", "qwen3_moe", "deepseek_v3"} <= set(refused), refused


# ----------------------------------------------------------------------------------------------- tiny models
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
               bos_token_id=0, eos_token_id=1, pad_token_id=0, attn_implementation="eager")


class HFModule(_CausalLMModule):
    """A tiny Hugging Face causal LM built from its configuration with random weights."""

    def __init__(self, config_name: str, model_name: str, lr: float = 1e-3, **overrides) -> None:
        super().__init__(lr=lr)
        config = getattr(transformers, config_name)(**{**_COMMON, **overrides})
        self.model = getattr(transformers, model_name)(config)


def phi3(**kw):
    return HFModule("Phi3Config", "Phi3ForCausalLM", **kw)


def qwen3(**kw):
    return HFModule("Qwen3Config", "Qwen3ForCausalLM", head_dim=16, **kw)


def mixtral(**kw):
    return HFModule("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, **kw)


def qwen3_moe(**kw):
    return HFModule("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=16, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, decoder_sparse_step=1, **kw)


def _tokens(batch):
    return RandomTokenDataModule(batch_size=batch)


def _tp2(factory, tp_plan="auto"):
    reference, _ = fit(factory, lambda: _tokens(GLOBAL_BATCH), None, 1, STEPS)
    result, _ = fit(factory, lambda: _tokens(GLOBAL_BATCH), {"tensor_parallel_size": 2, "tp_plan": tp_plan}, 2, STEPS)
    assert_same_training(reference, result, weight_atol=TP_WEIGHT_ATOL)
    return reference, result


def test_phi3_trains_under_tp2_with_its_own_plan():
    plan = auto_plan(phi3())
    assert plan["model.model.layers.*.self_attn.qkv_proj"] == "colwise_gather_output"
    assert plan["model.model.layers.*.self_attn.o_proj"] == "rowwise_split_input"
    assert plan["model.model.layers.*.mlp.gate_up_proj"] == "colwise_gather_output"
    _tp2(phi3)


def test_qwen3_per_head_norms_train_under_tp2():
    plan = auto_plan(qwen3())
    assert plan["model.model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    _tp2(qwen3)


def _refusal(factory) -> str:
    with pytest.raises(ValueError) as error:
        auto_plan(factory())
    return str(error.value)


def _explicit_plan(message: str) -> dict[str, str]:
    import ast

    return ast.literal_eval(message.split("tp_plan=", 1)[1])


@pytest.mark.parametrize("factory", [mixtral, qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_moe_is_refused_naming_the_style_and_the_explicit_plan_trains(factory):
    message = _refusal(factory)
    assert re.search(r"uses styles \['moe_tp_experts', 'packed_colwise'\]", message), message
    assert "keeps ['model.model.layers.*.mlp.experts'] replicated" in message, message
    plan = _explicit_plan(message)
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise" and not any("experts" in g for g in plan)
    _tp2(factory, plan)


def _apply_worker(factory, tp):
    torch.distributed.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    try:
        apply_tensor_parallel(factory(), mesh, "auto", sequence_parallel=False)
    except ValueError as error:
        return str(error)
    return "no error"


def test_key_value_heads_not_divisible_fail_before_training_with_the_valid_degrees():
    messages = run_distributed(_apply_worker, 4, lambda: qwen3(num_key_value_heads=2), 4, timeout=120)
    assert re.search(r"tensor_parallel_size=4 must divide.*config.num_key_value_heads = 2.*Valid tensor_parallel_size"
                     r" values for this model and plan: \[2\]", messages[0]), messages[0]
