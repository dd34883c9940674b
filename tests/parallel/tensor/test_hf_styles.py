"""Every style in the installed transformers' tensor-parallel vocabulary is mapped or refused by name, before training.

The vocabulary is read from transformers itself (its style registry and every model's plan), so a transformers
release with a new style fails here until that style is mapped or refused on purpose.
"""

from __future__ import annotations

import contextlib
import functools
import re

import pytest
import torch

from lightning_mgpu.parallel.tensor.plan import _HF_REFUSED, _HF_STYLES, STYLE_NAMES, auto_plan
from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import assert_same_training
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
    # Experts: the module on local shards of its 3-D parameters, placed by the parameter entries (tensor/experts.py).
    "moe_tp_experts": "moe_tp_experts",
    "moe_identity_expert": "moe_identity_expert",
    "packed_colwise": "packed_colwise",
    "packed_rowwise": "packed_rowwise",
}
REFUSED = {"grouped_gemm", "ep_dispatch_experts", "mla_kv_a_proj", "all_reduce", "local_params"}


def _registered_styles() -> set[str]:
    import transformers.distributed.expert_parallel
    import transformers.distributed.tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return set(ALL_PARALLEL_STYLES._global_mapping)


def _declared_plans() -> dict[str, list[dict[str, str]]]:
    """``{model_type: [base_model_tp_plan, ...]}`` for every configuration declaring one, itself or in a
    sub-configuration (the text model of a multimodal one)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    plans: dict[str, list[dict[str, str]]] = {}
    for model_type in list(CONFIG_MAPPING.keys()):
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception:  # a configuration needing an optional dependency
            continue
        for cls in (config_class, *getattr(config_class, "sub_configs", {}).values()):
            plan = getattr(cls, "base_model_tp_plan", None)
            if isinstance(plan, dict) and plan:
                plans.setdefault(model_type, []).append(dict(plan))
    return plans


def test_every_registered_style_is_mapped_or_refused():
    registered = _registered_styles()
    assert registered == set(MAPPED) | REFUSED, (
        f"transformers' style registry changed: new {sorted(registered - set(MAPPED) - REFUSED)},"
        f" gone {sorted((set(MAPPED) | REFUSED) - registered)}: map or refuse them in plan.py"
    )
    assert _HF_STYLES == MAPPED and set(_HF_REFUSED) == REFUSED
    assert set(MAPPED.values()) <= set(STYLE_NAMES)


@pytest.mark.slow  # the slow tier: published model code: every Hugging Face architecture's plan
def test_every_style_in_every_model_plan_is_mapped_or_refused():
    plans = _declared_plans()
    used = {style for group in plans.values() for plan in group for style in plan.values()}
    assert used <= set(MAPPED) | REFUSED, f"plans use styles neither mapped nor refused: {used - set(MAPPED) - REFUSED}"
    assert set(plans) == SERVED | REFUSED_MODELS | UNBUILT, (
        f"model types declaring a plan changed: new {sorted(set(plans) - SERVED - REFUSED_MODELS - UNBUILT)},"
        f" gone {sorted((SERVED | REFUSED_MODELS | UNBUILT) - set(plans))}"
    )


# Every model type of transformers 5.23 declaring a base_model_tp_plan (its configuration or a sub-configuration),
# by what tp_plan='auto' does with it. UNBUILT: the default configuration does not build a model on its own
# (a sub-configuration of a composite model, or an optional dependency); their styles are still checked above.
SERVED = {
    "afmoe",
    "apertus",
    "arcee",
    "aria",
    "aria_text",
    "axk1",
    "bailing_hybrid",
    "cohere",
    "cohere2",
    "cohere2_moe",
    "cosmos3_edge",
    "cosmos3_edge_text",
    "cwm",
    "deepseek_v3",
    "deepseek_v4",
    "doge",
    "embedding_gemma2",
    "embedding_gemma2_text",
    "ernie4_5",
    "ernie4_5_moe",
    "ernie4_5_vl_moe",
    "esmc",
    "eurobert",
    "exaone4",
    "exaone_moe",
    "flex_olmo",
    "flint",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gemma3n_text",
    "gemma4",
    "gemma4_text",
    "gemma4_unified",
    "gemma4_unified_text",
    "gemma4_vision",
    "glm",
    "glm4",
    "glm4_moe",
    "glm4v",
    "glm4v_moe",
    "glm4v_moe_text",
    "glm4v_text",
    "glm_image",
    "glm_image_text",
    "glm_ocr",
    "glm_ocr_text",
    "gpt_neox",
    "granite",
    "granite_docling",
    "granite_docling_text",
    "granitemoe",
    "granitemoehybrid",
    "granitemoeshared",
    "helium",
    "higgs_audio_v2",
    "hrm_text",
    "hy_v3",
    "hyperclovax",
    "inkling2",
    "inkling2_text",
    "internlm3",
    "iquestcoder",
    "jais2",
    "jamba",
    "kimi_linear",
    "kolibri1",
    "laguna",
    "llama",
    "llama4_text",
    "mellum",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl",
    "minimax_m3_vl_text",
    "ministral3",
    "mistral",
    "mistral4",
    "mistral_large4",
    "mistral_large4_text",
    "mixtral",
    "muse_glimmer",
    "muse_glimmer_assistant",
    "muse_glimmer_text",
    "muse_glimmer_vision",
    "muse_spark",
    "muse_spark_text",
    "nanochat",
    "nemotron_h",
    "neomme",
    "olmo",
    "olmo2",
    "olmo3",
    "olmo_hybrid",
    "olmoe",
    "paddleocr_vl",
    "phi",
    "phi3",
    "phi4_multimodal",
    "phimoe",
    "qwen2",
    "qwen2_5_omni_thinker",
    "qwen2_5_vl",
    "qwen2_5_vl_text",
    "qwen2_moe",
    "qwen2_vl",
    "qwen2_vl_text",
    "qwen3",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_omni_moe_thinker",
    "qwen3_vl_moe",
    "qwen3_vl_moe_text",
    "seed_oss",
    "smollm3",
    "solar_open",
    "starcoder2",
    "step3p7",
    "t5gemma",
    "t5gemma2",
    "ultrabert",
    "unlimited_ocr",
    "vaultgemma",
    "youtu",
}
# Refused by name (each plan also shards its experts, 'moe_tp_experts'): DeepSeek-style MLA ('mla_kv_a_proj'),
# attention sinks ('local_params'), a shared expert all-reduced by a hook ('all_reduce').
REFUSED_MODELS = {
    "axk2",
    "beam",
    "deepseek_v2",
    "deepseek_v32",
    "dots3_note_text",
    "glm4_moe_lite",
    "glm5_next",
    "glm5_next_text",
    "glm_moe_dsa",
    "granite_swa",
    "granitemoe_swa",
    "hy_v4",
    "inkling_mm_model",
    "inkling_text",
    "longcat_flash",
    "mimo_v2_flash",
    "minicpm3",
}
UNBUILT = {
    "cohere_compass",
    "cohere_compass_text",
    "deepseek_ocr2",
    "deepseek_ocr2_encoder",
    "deepseek_ocr2_text",
    "deepseek_ocr2_vision",
    "diffusion_gemma",
    "diffusion_gemma_text",
    "dots1",
    "dots3_note",
    "dots3_note_vision_encoder",
    "ernie4_5_vl_moe_text",
    "ernie4_5_vl_moe_vision",
    "gemma3n",
    "granite4_vision",
    "granite4_vision_text",
    "hunyuan_v1_moe",
    "lfm2_moe",
    "llama4",
    "llama4_vision_model",
    "ministral",
    "nemotron",
    "paddleocr_vl_text",
    "qwen2_5_omni_text",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_omni_moe_talker_code_predictor",
    "qwen3_omni_moe_talker_text",
    "qwen3_omni_moe_text",
    "qwen4_exp",
    "qwen4_exp_text",
    "step3p5",
    "t5_gemma_module",
    "t5gemma2_decoder",
    "t5gemma2_encoder",
    "t5gemma2_text",
    "unlimited_ocr_text",
    "voxtral_realtime_text",
}


@contextlib.contextmanager
def _no_torch_initializers():
    """torch.nn.init's initializers as no-ops while a model is built on the meta device, where they compute nothing
    yet cost most of the build (``reset_parameters`` of tens of thousands of layers); the module tree, all a plan
    reads, is the same. Hugging Face's own initialization already skips the meta device; its weight tying still runs.
    """
    from transformers.initialization import TORCH_INIT_FUNCTIONS

    originals = {name: getattr(torch.nn.init, name) for name in TORCH_INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    for name in originals:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.nn.init, name, function)


def _model_on_meta(model_type: str):
    """The model (a causal LM where there is one) of ``model_type``'s default configuration, on the meta device:
    the plan depends on module names only, and the real sizes cost nothing there."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type)
    name = name[0] if isinstance(name, (list, tuple)) else name
    with torch.device("meta"), _no_torch_initializers():
        model = getattr(transformers, name)._from_config(CONFIG_MAPPING[model_type]())
    wrapper = torch.nn.Module()
    wrapper.model = model
    return wrapper


@pytest.mark.slow  # the slow tier: published model code: every Hugging Face architecture's plan
def test_auto_plan_of_every_architecture_maps_every_style_or_refuses_by_name():
    from lightning_mgpu.parallel.tensor.experts import expert_placements
    from lightning_mgpu.parallel.tensor.plan import _match

    outcomes = {}
    for model_type in sorted(SERVED | REFUSED_MODELS):
        module = _model_on_meta(model_type)
        try:
            plan = auto_plan(module)
        except ValueError as error:
            message = str(error)
            named = re.search(r"uses styles? \[([^\]]*)\]", message)
            assert named and set(re.findall(r"'(\w+)'", named.group(1))) <= REFUSED, (model_type, message)
            explicit = _explicit_plan(message)  # the plan offered instead is one this model accepts
            assert set(explicit.values()) <= set(STYLE_NAMES) and _match(module, explicit), (model_type, message)
            outcomes[model_type] = "refused"
        else:
            matched = _match(module, plan)
            assert set(plan.values()) <= set(STYLE_NAMES) and matched, (model_type, plan)
            expert_placements(module, plan, matched)  # every expert weight placed by the plan's parameter entries
            outcomes[model_type] = "served"
    assert {t for t, o in outcomes.items() if o == "served"} == SERVED, outcomes


# ----------------------------------------------------------------------------------------------- tiny models
_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    attn_implementation="eager",
)


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


def _tokens(batch):
    return RandomTokenDataModule(batch_size=batch)


# GPT-NeoX's losses match to 1e-5, but on some CPUs one weight of 8192 in an MLP's output sits on a near-zero
# gradient, which 10 AdamW steps turn into a 1.3e-4 difference (the same model, base commit included).
_NEAR_ZERO_GRADIENT_ATOL = {"gpt_neox": 3e-4}


def _tp2(name):
    """The run ``name`` of ``_trained()`` against its one-process reference."""
    reference_name = name.split("-")[0]
    reference = result(_references()[reference_name])
    atol = _NEAR_ZERO_GRADIENT_ATOL.get(reference_name, TP_WEIGHT_ATOL)
    assert_same_training(reference, result(_trained()[name])[0], weight_atol=atol)


@pytest.mark.slow  # the slow tier: published model code: Phi-3 trained under its own plan
def test_phi3_trains_under_tp2_with_its_own_plan():
    plan = auto_plan(phi3())
    # The fused grouped-query q|k|v is gathered and sliced, as Hugging Face's plan says (no layout gives each rank
    # its q heads with their k/v heads while keeping the tensor's layout); the packed gate|up is sharded as 2 chunks.
    assert plan["model.model.layers.*.self_attn.qkv_proj"] == "colwise_gather_output"
    assert plan["model.model.layers.*.self_attn.o_proj"] == "rowwise_split_input"
    assert plan["model.model.layers.*.mlp.gate_up_proj"] == "colwise_gate_up"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"
    _tp2("phi3-tp2")


@pytest.mark.slow  # the slow tier: published model code: Qwen3 trained under its own plan
def test_qwen3_per_head_norms_train_under_tp2():
    plan = auto_plan(qwen3())
    assert plan["model.model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    _tp2("qwen3-tp2")


def _refusal(factory) -> str:
    with pytest.raises(ValueError) as error:
        auto_plan(factory())
    return str(error.value)


def _explicit_plan(message: str) -> dict[str, str]:
    import ast

    return ast.literal_eval(message.split("tp_plan=", 1)[1])


def deepseek_v2(**kw):
    return HFModule(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        **kw,
    )


@pytest.mark.slow  # the slow tier: published model code: Hugging Face architectures trained under their own plans
def test_a_refused_style_is_named_and_the_explicit_plan_trains_with_its_experts_sharded():
    """DeepSeek-V2: MLA ('mla_kv_a_proj') is refused; the plan offered keeps that attention whole and still shards
    the routed experts (tensor/experts.py), the shared experts and the dense MLP."""
    message = _refusal(deepseek_v2)
    assert re.search(r"uses style \['mla_kv_a_proj'\]", message), message
    assert "keeps ['model.model.layers.*.self_attn'] replicated" in message, message
    plan = _explicit_plan(message)
    assert plan["model.model.layers.*.mlp.experts"] == "moe_tp_experts"
    assert plan["model.model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert not any("self_attn" in g for g in plan)
    _tp2("deepseek_v2-tp2")


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
    assert re.search(
        r"tensor_parallel_size=4 must divide.*config.num_key_value_heads = 2.*Valid tensor_parallel_size"
        r" values for this model and plan: \[2\]",
        messages[0],
    ), messages[0]


def _phi3_step_worker(plans):
    torch.distributed.init_process_group("gloo")
    return [_phi3_step(plan) for plan in plans]


def _phi3_step(plan):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    module = phi3()
    apply_tensor_parallel(module, mesh, plan, sequence_parallel=False)
    weight = module.model.model.layers[0].mlp.gate_up_proj.weight
    tokens = torch.randint(0, 128, (2, 17))
    with CommDebugMode() as comm:
        logits = module(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1)).backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return {
        "counts": counts,
        "placements": str(weight.placements) if isinstance(weight, DTensor) else None,
        "local": tuple(weight.to_local().shape),
        "loss": float(logits.float().logsumexp(-1).mean()),
    }


def test_phi3_packed_gate_up_is_sharded_as_two_chunks_without_gathering():
    hf_semantics = {
        glob: "colwise_gather_output"
        if s == "colwise_gate_up"
        else "rowwise_split_input"
        if glob.endswith("mlp.down_proj")
        else s
        for glob, s in auto_plan(phi3()).items()
    }
    auto, gathered = run_distributed(_phi3_step_worker, 2, ["auto", hf_semantics], timeout=120)[0]
    assert "_StridedShard" in auto["placements"] and auto["local"] == (128, 64), auto  # halves of gate and of up
    # Per layer, the gathered MLP costs an all-gather forward and one backward more (2 layers).
    assert auto["counts"].get("all_gather_into_tensor", 0) + 4 == gathered["counts"].get("all_gather_into_tensor"), (
        auto,
        gathered,
    )
    assert auto["loss"] == pytest.approx(gathered["loss"], rel=1e-6)


# Further architectures trained under tp=2 with their own plans, each exercising a mapping: Mistral and Qwen2 plain
# colwise/rowwise; OLMo-2 q/k/v gathered for its full-width q/k norms, o_proj 'rowwise_split_input'; GLM-4 a packed
# gate_up_proj ('colwise_gate_up'); Gemma-2 soft-capping and sandwich norms; StarCoder2 biases and LayerNorm;
# GPT-NeoX a fused query_key_value laid out per head (plain 'colwise' keeps each head's q, k, v together).
TRAINED = {
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
}


@pytest.mark.slow  # the slow tier: published model code: Hugging Face architectures trained under their own plans
@pytest.mark.parametrize("model_type", sorted(TRAINED))
def test_architecture_trains_under_tp2_with_its_own_plan(model_type):
    assert model_type in SERVED
    _tp2(f"{model_type}-tp2")


COMPOSED = [  # (name, model, strategy extras, devices, dp)
    ("phi3-tp2-sp", phi3, {"sequence_parallel": True}, 2, 1),
    ("qwen3-tp2-sp", qwen3, {"sequence_parallel": True}, 2, 1),
    ("phi3-dp2-tp2-zero1", phi3, {"zero_stage": 1}, 4, 2),
    ("qwen3-dp2-tp2-zero3", qwen3, {"zero_stage": 3}, 4, 2),
]


@pytest.mark.slow  # the slow tier: published model code: Hugging Face architectures trained under their own plans
@pytest.mark.parametrize(("name", "factory", "extra", "devices", "dp"), COMPOSED, ids=[c[0] for c in COMPOSED])
def test_new_styles_compose_with_sequence_parallel_and_zero(name, factory, extra, devices, dp):
    _tp2(name)


# ------------------------------------------------------------------------------- the fits, one job per world size
def _architecture(config_name, model_name):
    return lambda: HFModule(config_name, model_name)


def _factories():
    factories = {"phi3": phi3, "qwen3": qwen3, "deepseek_v2": deepseek_v2}
    factories.update({model_type: _architecture(*names) for model_type, names in TRAINED.items()})
    return factories


@functools.cache
def _references():
    """Every model's one-process run, in one job."""
    return references({name: Run(factory, lambda: _tokens(GLOBAL_BATCH)) for name, factory in _factories().items()})


@functools.cache
def _trained():
    """Every layout's run, in one job per world size: the tp=2 runs with each model's plan ('auto', or the explicit
    plan DeepSeek-V2's refusal offers), then sequence parallelism and ZeRO over dp=2."""
    plans = dict.fromkeys(_factories(), "auto")
    plans["deepseek_v2"] = _explicit_plan(_refusal(deepseek_v2))
    strategy = lambda name: {"tensor_parallel_size": 2, "tp_plan": plans[name]}
    runs = {f"{name}-tp2": Run(f, lambda: _tokens(GLOBAL_BATCH), strategy(name)) for name, f in _factories().items()}
    by_devices = {2: runs, 4: {}}
    for name, factory, extra, devices, dp in COMPOSED:
        batch = GLOBAL_BATCH // dp
        by_devices[devices][name] = Run(factory, lambda b=batch: _tokens(b), {"tensor_parallel_size": 2, **extra})
    return {name: r for devices, group in by_devices.items() for name, r in fit_each(group, devices, 1200).items()}
