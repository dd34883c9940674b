"""Every architecture of the installed transformers that declares a ``base_model_tp_plan`` trains under tp=2 like one
process, or is refused before training with its reason, or is named below as not buildable tiny on CPU.

Each model is built from its own configuration class shrunk generically (``_TINY``: widths, layers, heads, experts,
vocabulary) with random weights, the text model where the plan is declared on a multimodal model's text
sub-configuration. Affordable as one job: two ranks of one 3-process job train every served architecture in turn,
sharded as ``HybridStrategy(tensor_parallel_size=2)`` shards it at dp=1 (``apply_tensor_parallel`` with
``tp_plan="auto"``, steps in ``tensor_parallel_context``, AdamW stepped on the local shards by ``ShardLocalStep``),
in a plain loop: a Lightning ``Trainer`` per architecture would cost ten times the training itself. Each rank builds
each model once and first decides with the strategy's own check whether it is refused before training. The reference
is the same loop unsharded, in a third process of that job: it runs on the cores the two sharded ranks leave idle,
instead of after them. The strategy's own loop is covered for a dozen of these architectures by
test_tensor_hf_styles.py.

To run some architectures only (after a library change, say): ``TP_ARCHITECTURES=doge,llama pytest -q <this file>
-k every_architecture_with``.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import LOSS_RTOL, RunResult, assert_same_training
from tests.parallel.tensor.test_hf_styles import _declared_plans

pytestmark = pytest.mark.slow  # the slow tier: every Hugging Face architecture with a plan, under tp 2


transformers = pytest.importorskip("transformers")

STEPS = 10
BATCH = 8
SEQUENCE = 32
SEED = 1234
VOCAB = 128
# Losses are held to 1e-5; weights looser than test_tensor.py's 1e-4: over a hundred models, AdamW turns ~1e-7
# gradient noise on near-zero gradients (embedding rows of unseen tokens) into steps of up to ~lr = 1e-3.
TP_WEIGHT_ATOL = 2e-3
MAX_PARAMETERS = 8_000_000  # a shrunk model above this was not shrunk by _TINY: a new size field to add there

# Configuration fields shrunk wherever a configuration class has them (its own defaults otherwise).
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=16,
    num_kv_shared_layers=0,
    num_layers=2,
    ffn_hidden_size=128,
    expert_ffn_hidden_size=32,
    moe_topk=2,
    zero_expert_num=2,
    shared_experts_intermediate_size=32,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=16,
    linear_num_heads=4,
    linear_head_dim=16,
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_d_state=16,
    mamba_chunk_size=16,
    mamba_num_heads=4,
    mamba_head_dim=32,
    ssm_state_size=16,
    n_groups=1,
    chunk_size=16,
    attention_dropout=0.0,
    residual_dropout=0.0,  # dropout draws differ on shards: off, as in every test
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=1,
)

# Every model type of transformers 5.23 declaring a base_model_tp_plan (itself or in a sub-configuration).
ARCHITECTURES = sorted(
    """
afmoe apertus arcee aria aria_text axk1 axk2 bailing_hybrid beam cohere cohere2 cohere2_moe cohere_compass
cohere_compass_text cosmos3_edge cosmos3_edge_text cwm deepseek_ocr2 deepseek_ocr2_encoder deepseek_ocr2_text
deepseek_ocr2_vision deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 diffusion_gemma diffusion_gemma_text doge dots1
dots3_note dots3_note_text dots3_note_vision_encoder embedding_gemma2 embedding_gemma2_text ernie4_5 ernie4_5_moe
ernie4_5_vl_moe ernie4_5_vl_moe_text ernie4_5_vl_moe_vision esmc eurobert exaone4 exaone_moe flex_olmo flint gemma
gemma2 gemma3 gemma3_text gemma3n gemma3n_text gemma4 gemma4_text gemma4_unified gemma4_unified_text gemma4_vision glm
glm4 glm4_moe glm4_moe_lite glm4v glm4v_moe glm4v_moe_text glm4v_text glm5_next glm5_next_text glm_image
glm_image_text glm_moe_dsa glm_ocr glm_ocr_text gpt_neox granite granite4_vision granite4_vision_text granite_docling
granite_docling_text granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared helium higgs_audio_v2
hrm_text hunyuan_v1_moe hy_v3 hy_v4 hyperclovax inkling2 inkling2_text inkling_mm_model inkling_text internlm3
iquestcoder jais2 jamba kimi_linear kolibri1 laguna lfm2_moe llama llama4 llama4_text llama4_vision_model
longcat_flash mellum mimo_v2_flash minicpm3 minimax minimax_m2 minimax_m3_vl minimax_m3_vl_text ministral ministral3
mistral mistral4 mistral_large4 mistral_large4_text mixtral muse_glimmer muse_glimmer_assistant muse_glimmer_text
muse_glimmer_vision muse_spark muse_spark_text nanochat nemotron nemotron_h neomme olmo olmo2 olmo3 olmo_hybrid olmoe
paddleocr_vl paddleocr_vl_text phi phi3 phi4_multimodal phimoe qwen2 qwen2_5_omni_text qwen2_5_omni_thinker
qwen2_5_vl qwen2_5_vl_text qwen2_moe qwen2_vl qwen2_vl_text qwen3 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text
qwen3_moe qwen3_next qwen3_omni_moe_talker_code_predictor qwen3_omni_moe_talker_text qwen3_omni_moe_text
qwen3_omni_moe_thinker qwen3_vl_moe qwen3_vl_moe_text qwen4_exp qwen4_exp_text seed_oss smollm3 solar_open starcoder2
step3p5 step3p7 t5_gemma_module t5gemma t5gemma2 t5gemma2_decoder t5gemma2_encoder t5gemma2_text ultrabert
unlimited_ocr unlimited_ocr_text vaultgemma voxtral_realtime_text youtu
""".split()
)

_NO_MODEL = "the configuration holding the plan has no model class of its own (only the composite model, which needs"
_VISION = "a vision/audio encoder: its forward needs pixel or audio inputs, not token ids"
NOT_BUILDABLE = {  # model type -> why it is not trained here
    **dict.fromkeys(
        (
            "deepseek_ocr2",
            "deepseek_ocr2_text",
            "diffusion_gemma",
            "diffusion_gemma_text",
            "ernie4_5_vl_moe",
            "ernie4_5_vl_moe_text",
            "granite4_vision",
            "granite4_vision_text",
            "paddleocr_vl",
            "paddleocr_vl_text",
            "qwen2_5_omni_text",
            "qwen2_5_omni_thinker",
            "qwen3_omni_moe_talker_code_predictor",
            "qwen3_omni_moe_talker_text",
            "qwen3_omni_moe_text",
            "qwen3_omni_moe_thinker",
            "step3p5",
            "step3p7",
            "unlimited_ocr",
            "unlimited_ocr_text",
            "voxtral_realtime_text",
        ),
        f"{_NO_MODEL} image or audio inputs)",
    ),
    **dict.fromkeys(
        ("t5_gemma_module", "t5gemma", "t5gemma2", "t5gemma2_decoder", "t5gemma2_encoder", "t5gemma2_text"),
        f"{_NO_MODEL} encoder and decoder inputs)",
    ),
    **dict.fromkeys(
        (
            "deepseek_ocr2_encoder",
            "deepseek_ocr2_vision",
            "dots3_note_vision_encoder",
            "ernie4_5_vl_moe_vision",
            "gemma4_vision",
            "llama4_vision_model",
            "muse_glimmer_vision",
        ),
        _VISION,
    ),
    "muse_glimmer_assistant": "its forward needs noise embeddings and context hidden states, not token ids",
    "phi4_multimodal": "the plan is on the multimodal model itself, which builds its vision and audio encoders too",
    **dict.fromkeys(
        ("cohere_compass", "cohere_compass_text"),
        "its own default configuration does not build: the rotary embedding reads rope parameters per layer type"
        " that the configuration leaves empty (KeyError 'full_attention')",
    ),
    "lfm2_moe": "its own default configuration does not build: layer_types is None and the layers index it",
    **dict.fromkeys(
        ("granitemoehybrid", "jamba"),
        "shrunk to 2 layers (no attention layer among them), its default cache fails in one process: transformers"
        " calls get_seq_length on a cache of linear-attention layers only",
    ),
    **dict.fromkeys(
        ("qwen4_exp", "qwen4_exp_text"), "its own default configuration does not build: the indexer sizes are None"
    ),
    **dict.fromkeys(
        ("dots3_note", "dots3_note_text"),
        "does not shrink below 38M parameters with the generic fields of _TINY (indexed attention sizes)",
    ),
    **dict.fromkeys(
        ("bailing_hybrid", "kimi_linear"),
        "no shrunk configuration of _VARIANTS runs a forward (its linear-attention sizes are derived from fields"
        " beyond the generic ones)",
    ),
}


# Served by tp_plan='auto' but not yet training like one process (found by this matrix): each a library gap to close.
# The test fails when one of them starts to pass (remove it here) or another one fails. Closed so far: doge and
# neomme (per-head parameters, a per-head row-parallel output and per-head inputs follow the rank's heads:
# heads.py), gemma3n (its MLP's activation sparsity reduces over the sharded width: found by a trial call and
# run on global shapes, mixing.py).
KNOWN_DIVERGENT: dict[str, str] = {}

# Training these is chaotic in one process already: weights perturbed by 1e-7 relative (rounding noise) move their
# losses by 5e-5 to 7e-3 within the 10 steps, so no sharded run, whose sums round differently, can stay within 1e-5
# of them to the end. Held instead (``_assert_within_rounding_drift``) to: the first step's loss within 1e-5, every
# later loss within CHAOTIC_MARGIN times the drift that the noise alone causes; the test fails if one stops being
# chaotic. The value: the seed of the perturbation that shows it.
# mistral_large4: discrete choices on near-ties. Its indexer picks each query's top-16 keys; at step 4 (of 10) four
# query rows of layer 1 pick another key under tp=2 than in one process (every top-k choice equal before; layer
# outputs within 7e-6 relative), which moves that layer's output by 2.5e-2 and the losses by 1e-5 to 5.7e-5 later.
# Four of six 1e-7 perturbations of the unsharded run (seeds 2-5) flip the same rows, with the same losses as tp=2
# to 1e-7; the test's own seed (1234) and seed 1 do not (drift 9e-8, 1.8e-7). Which seeds flip them depends on the
# CPU's kernels: on the machine of 2026-11-28 seed 2 no longer did (drift 3.5e-7) and seed 3 does.
# gemma3n: its activation sparsity keeps an MLP feature where it exceeds mean + 1.645 std over the features (ReLU
# of the difference): a feature on the threshold flips its gradient, and AdamW moves its weights ~lr. Perturbations
# of 1e-7 move its losses by 4.6e-5 / 8.6e-6 / 1.6e-5 (seeds 1234, 1, 2) and 11 to 66 of layer 0's gate weights by
# 2.6e-3 to 4.8e-3; tp=2 moves its losses by 8.9e-6 at most (first step 1e-7; 2.4e-5 while each rank thresholded by
# its own half's statistics) and 13 gate weights by up to 2.9e-3.
CHAOTIC = {"gemma4": SEED, "gemma4_unified": SEED, "muse_spark": SEED, "mistral_large4": 3, "gemma3n": SEED}
CHAOTIC_MARGIN = 10.0

# Weights on a near-tie in one process already: losses hold 1e-5, but a few weights move by about one AdamW step
# (lr 1e-3) when rounding changes. Held to: losses within 1e-5, and each tensor's weights within WEIGHT_MARGIN times
# what 1e-7 relative weight noise (the value: its seed) moves that tensor by in one process, or TP_WEIGHT_ATOL
# where the noise moves it less. The kernels decide which rounding lands on the tie, so this shows on some CPUs
# only. nemotron_h: measured on a Xeon with AVX-512/AMX (2026-11-27), tp=2 moved 2 of the 8192 weights of layer 1's
# routed experts' down_proj by up to 2.68e-3, and seed 1234's noise moves the same tensor by 2.68e-3 in one process
# (seeds 1 and 2: 1.4e-4 and 7.8e-5 at most, anywhere; loss drift 5.9e-6, 2.9e-7, 9.8e-8); every other weight and
# every loss within tolerance. An earlier machine trained it within TP_WEIGHT_ATOL.
WEIGHT_SENSITIVE = {"nemotron_h": SEED}
WEIGHT_MARGIN = 2.0
NOISE_SEEDS = {**CHAOTIC, **WEIGHT_SENSITIVE}  # the models rank 2 also trains from perturbed weights


# ------------------------------------------------------------------------------------------------- tiny models
def _plan_holder(model_type: str) -> type:
    """The configuration class declaring the plan: a text sub-configuration before the composite's own."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    subs = [c for c in getattr(config_class, "sub_configs", {}).values() if getattr(c, "base_model_tp_plan", None)]
    text = [c for c in subs if not any(word in c.model_type for word in ("vision", "encoder", "audio"))]
    return (text or ([config_class] if getattr(config_class, "base_model_tp_plan", None) else subs))[0]


def _model_class(config_class: type) -> type:
    from transformers.models.auto import modeling_auto as auto

    for mapping in (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_MAPPING_NAMES,
    ):
        name = mapping.get(config_class.model_type)
        if name:
            return getattr(transformers, name[0] if isinstance(name, (list, tuple)) else name)
    raise LookupError(f"no model class for {config_class.__name__}")


def _tiny_config(config_class: type, **variant: Any) -> Any:
    """``config_class`` with every field of ``_TINY`` it has (a size of 0 means "none" and stays); per-layer lists
    keep one layer of each of their first two kinds; multimodal rotary sections are rescaled to the smaller head."""
    default = config_class()
    values = default.to_dict()
    kwargs = {k: v for k, v in {**_TINY, **variant}.items() if k in values and values[k] != 0}
    layers = values.get("num_hidden_layers", values.get("num_layers"))
    for name, value in values.items():
        if (
            isinstance(value, list)
            and len(value) == layers
            and not isinstance(getattr(config_class, name, None), property)
        ):
            kinds = list(dict.fromkeys(map(str, value)))[:2]
            kwargs[name] = [next(v for v in value if str(v) == kind) for kind in (kinds * 2)[:2]]
    rope = getattr(default, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("mrope_section"):
        head_dim = kwargs.get("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        sections = rope["mrope_section"]
        scaled = [max(1, s * (head_dim // 2) // sum(sections)) for s in sections]
        scaled[-1] += head_dim // 2 - sum(scaled)
        kwargs["rope_parameters"] = {**rope, "mrope_section": scaled}
    return config_class(**kwargs, attn_implementation="eager")


# Tried in order until the shrunk model runs a forward: grouped-query key/value heads; one per head (multi-head only
# configurations); a head as wide as the rotary part (latent attention taking head_dim for it); 64- and 128-wide
# heads (multimodal rotary sections fixed in the model code).
_VARIANTS = (
    {},
    {"num_key_value_heads": 4},
    {"head_dim": 8},
    {"num_key_value_heads": 4, "head_dim": 8},
    {"hidden_size": 256, "head_dim": 64, "intermediate_size": 256},
    {"hidden_size": 512, "head_dim": 128, "intermediate_size": 256},
)


def _tiny_model(model_type: str) -> torch.nn.Module:
    config_class = _plan_holder(model_type)
    model_class = _model_class(config_class)
    errors = []
    for variant in _VARIANTS:
        try:
            config = _tiny_config(config_class, **variant)
            with torch.device("meta"):
                size = sum(p.numel() for p in model_class(config).parameters())
            assert size <= MAX_PARAMETERS, f"{size} parameters once shrunk; add its size fields to _TINY"
            model = model_class(config)
            with torch.no_grad():
                _loss(model, torch.zeros(1, 9, dtype=torch.long))
            return model
        except Exception as error:  # the next variant
            errors.append(f"{variant}: {type(error).__name__}: {error}")
    raise RuntimeError(f"{model_type}: no tiny configuration runs:\n" + "\n".join(errors))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The next-token loss on the logits; for a base model (its last hidden states) or a head over another
    vocabulary, on the output read out by a fixed random matrix (``_readout``)."""
    output = model(input_ids=tokens[:, :-1])
    logits = getattr(output, "logits", None)
    if logits is None or logits.size(-1) != VOCAB:
        logits = _readout(output.last_hidden_state if logits is None else logits)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _readout(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` times a fixed random ``[width, VOCAB]`` matrix, the same in every process. Not the mean square of
    the output: most outputs are RMS-normalized, so their mean square is ~1 whatever the weights, and every gradient
    but the last norm's is rounding noise that AdamW scales up to steps of ~lr."""
    width = hidden.size(-1)
    matrix = torch.randn(width, VOCAB, generator=torch.Generator().manual_seed(SEED)) / width**0.5
    return hidden.float() @ matrix


def _train(model_type: str, tp_mesh: Any = None, noise: float = 0.0, noise_seed: int = SEED) -> dict[str, Any]:
    """10 AdamW steps of the tiny model, sharded over ``tp_mesh`` as ``HybridStrategy(tensor_parallel_size)`` does
    (``apply_tensor_parallel`` with ``tp_plan="auto"``, each step and its backward in ``tensor_parallel_context``)."""
    from torch.distributed.tensor import DTensor

    from lightning_mgpu.parallel.local_step import ShardLocalStep
    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel
    from lightning_mgpu.parallel.tensor.sharding import tensor_parallel_context

    torch.manual_seed(SEED)
    model = _tiny_model(model_type)
    refusal = _refusal(model)
    if refusal is not None:
        return {"refused": refusal}
    with torch.no_grad():  # ``noise``: relative perturbation of every weight (``_rounding_drift``)
        for param in model.parameters() if noise else ():
            param.mul_(1 + noise * torch.randn(param.shape, generator=torch.Generator().manual_seed(noise_seed)))
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, "auto", sequence_parallel=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if tp_mesh is not None:  # stepped on the local shards, as the strategy steps it (module_setup.py)
        ShardLocalStep(optimizer)
    batches = torch.randint(0, VOCAB, (STEPS, BATCH, SEQUENCE + 1), generator=torch.Generator().manual_seed(SEED))
    losses = []
    for tokens in batches:
        with tensor_parallel_context(False):
            loss = _loss(model, tokens)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        losses.append(float(loss))
    # Gathered outside autograd: a rank once died with SIGSEGV inside the autograd-wrapped wait of full_tensor()'s
    # all-gather on a trained parameter (2026-11-27, 1 run in 3); the weights need no graph.
    with torch.no_grad():
        weights = {
            n: (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()
        }
    return {"losses": losses, "state_dict": weights}


def _refusal(model: torch.nn.Module) -> str | None:
    """Why ``apply_tensor_parallel`` refuses ``model`` at tp=2 before training (its own check), or None."""
    from lightning_mgpu.parallel.tensor.checks import check_divisible
    from lightning_mgpu.parallel.tensor.plan import _match, auto_plan

    try:
        check_divisible(model, _match(model, auto_plan(model)), 2)
    except ValueError as error:
        return str(error)
    return None


def _served_as(model_type: str) -> str:
    """What is trained for ``model_type``: its plan's configuration class and model class."""
    config_class = _plan_holder(model_type)
    return f"{config_class.__name__}/{_model_class(config_class).__name__}"


def _train_every(model_types: list[str]) -> dict[str, Any]:
    """In one process of a 3-process job, every model type in turn is built and refused before training where
    ``apply_tensor_parallel`` refuses it (``{"refused": reason}``); otherwise ranks 0 and 1 form the tp=2 group and
    train it sharded (an error is recorded and the next one trained), while rank 2 trains it unsharded (the
    reference), and a CHAOTIC or WEIGHT_SENSITIVE one also from perturbed weights (under "noisy"): the sharded
    ranks take longer. Rank 0 returns the sharded results, rank 2 the references (an error there fails the test), rank 1
    nothing."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = int(os.environ["RANK"])
    if rank == 2:
        references = {model_type: _train(model_type) for model_type in model_types}
        for model_type in set(NOISE_SEEDS) & set(model_types):
            if "refused" not in references[model_type]:
                references[model_type]["noisy"] = _train(model_type, noise=1e-7, noise_seed=NOISE_SEEDS[model_type])
        return references
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    results: dict[str, Any] = {}
    for model_type in model_types:
        try:
            results[model_type] = _train(model_type, mesh)
        except Exception:
            results[model_type] = {"error": traceback.format_exc()[-3000:]}
    return results if rank == 0 else {}


def _relative(reference: list[float], other: list[float]) -> list[float]:
    return [abs(a - b) / abs(a) for a, b in zip(reference, other)]


def _assert_within_rounding_drift(expected: list[float], noisy: list[float], losses: list[float]) -> None:
    """A CHAOTIC model: ``noisy`` is the reference trained from weights perturbed by 1e-7 relative."""
    drift, gap = max(_relative(expected, noisy)), _relative(expected, losses)
    assert drift > LOSS_RTOL, f"not chaotic any more (1e-7 weight noise moves losses {drift:.1e}): remove from CHAOTIC"
    assert gap[0] <= LOSS_RTOL, f"the first step's loss differs by {gap[0]:.1e} relative"
    assert max(gap) <= CHAOTIC_MARGIN * drift, (
        f"losses differ by up to {max(gap):.1e} relative, more than {CHAOTIC_MARGIN:g} x the {drift:.1e} that 1e-7"
        " weight noise alone causes"
    )


def _assert_within_weight_drift(expected: RunResult, noisy_state: dict[str, Any], result: RunResult) -> None:
    """A WEIGHT_SENSITIVE model: losses as for any model, each weight tensor within ``WEIGHT_MARGIN`` times the
    distance 1e-7 weight noise puts between ``noisy_state`` and the reference (at least ``TP_WEIGHT_ATOL``)."""
    drift = {k: (noisy_state[k].float() - v.float()).abs().max().item() for k, v in expected.state_dict.items()}
    atols = {k: max(TP_WEIGHT_ATOL, WEIGHT_MARGIN * d) for k, d in drift.items()}
    assert_same_training(expected, result, weight_rtol=0.0, weight_atol=TP_WEIGHT_ATOL, weight_atols=atols)


def test_every_architecture_with_a_plan_trains_under_tp2_like_one_process_or_is_refused_before_training():
    assert sorted(_declared_plans()) == ARCHITECTURES, "transformers' architectures with a plan changed"
    selected = os.environ.get("TP_ARCHITECTURES", "").split(",") if os.environ.get("TP_ARCHITECTURES") else None
    buildable = [t for t in ARCHITECTURES if t not in NOT_BUILDABLE and (selected is None or t in selected)]
    # Model types sharing a configuration and model class (a composite and its text model) are built once.
    same: dict[str, list[str]] = {}
    for model_type in buildable:  # also imports each model's module here, once, rather than in every forked process
        same.setdefault(_served_as(model_type), []).append(model_type)
    built = [types[0] for types in same.values()]
    sharded, _, expected = run_distributed(_train_every, 3, built, timeout=900)  # one intra-op thread each
    outcome = {t: sharded[types[0]] for types in same.values() for t in types}
    refused = {t: result["refused"] for t, result in outcome.items() if "refused" in result}
    for model_type, reason in refused.items():  # a reason the user can act on: the style or the valid degrees
        assert "does not map" in reason or "Valid tensor_parallel_size values" in reason, (model_type, reason)
    assert all(("refused" in expected[t]) == ("refused" in sharded[t]) for t in built)  # decided alike in each rank
    served = {holder: types for holder, types in same.items() if "refused" not in sharded[types[0]]}
    trained = [types[0] for types in served.values()]
    noisy = {t: expected[t].pop("noisy") for t in NOISE_SEEDS if t in trained}
    failures = {}
    for model_type in trained:
        if "error" in sharded[model_type]:
            failures[model_type] = sharded[model_type]["error"].strip().splitlines()[-1]
            continue
        result = sharded[model_type]
        try:
            if model_type in CHAOTIC:
                losses = noisy[model_type]["losses"]
                _assert_within_rounding_drift(expected[model_type]["losses"], losses, result["losses"])
            elif model_type in WEIGHT_SENSITIVE:
                state = noisy[model_type]["state_dict"]
                _assert_within_weight_drift(RunResult(**expected[model_type]), state, RunResult(**result))
            else:
                assert_same_training(RunResult(**expected[model_type]), RunResult(**result), weight_atol=TP_WEIGHT_ATOL)
        except AssertionError as error:
            failures[model_type] = " ".join(str(error).split())[:400]
    chaotic = len(set(CHAOTIC) & set(trained) - set(failures))
    summary = (
        f"tp=2 trains like one process: {len(trained) - len(failures)} of {len(trained)} model classes"
        f" ({sum(map(len, served.values()))} model types; {chaotic} of them chaotic, held to their rounding"
        f" drift); known divergent: {len(failures)}; refused before"
        f" training: {len(refused)}; not buildable tiny: {len(NOT_BUILDABLE)}"
    )
    print(summary)
    fixed = sorted(set(KNOWN_DIVERGENT) & set(trained) - set(failures))
    assert not fixed, f"{summary}\nnow training like one process: remove {fixed} from KNOWN_DIVERGENT"
    new = {t: why for t, why in failures.items() if t not in KNOWN_DIVERGENT}
    assert not new, f"{summary}\n" + "\n".join(f"{t}: {why}" for t, why in new.items())


# ------------------------------------------------------------------------------ nanoGPT, dp2 x tp2, ZeRO-3, bf16
BF16_RTOL = 2e-2  # the bound for bf16-mixed
BF16_WEIGHT_ATOL = 1e-2  # 10 AdamW steps of lr 1e-3: bf16 rounding of near-zero gradients moves weights ~lr


def test_nanogpt_as_published_under_dp2_tp2_zero3_bf16_mixed_tracks_one_process():
    """Karpathy's nanoGPT (global shapes in its attention, a tied head) in the issue's composed layout; the other
    nanoGPT layouts are in test_tensor_global_shapes.py."""
    from tests.helpers.equivalence import fit
    from tests.helpers.modules import RandomTokenDataModule
    from tests.helpers.nanogpt import NanoGPTModule

    bf16 = {"precision": "bf16-mixed"}
    reference, _ = fit(NanoGPTModule, lambda: RandomTokenDataModule(batch_size=8), None, 1, STEPS, trainer_kwargs=bf16)
    fp32, _ = fit(NanoGPTModule, lambda: RandomTokenDataModule(batch_size=8), None, 1, STEPS)
    result, _ = fit(
        NanoGPTModule,
        lambda: RandomTokenDataModule(batch_size=4),
        {"tensor_parallel_size": 2, "zero_stage": 3},
        4,
        STEPS,
        trainer_kwargs=bf16,
    )
    assert result.losses != fp32.losses  # autocast really ran
    assert_same_training(reference, result, loss_rtol=BF16_RTOL, weight_rtol=0.0, weight_atol=BF16_WEIGHT_ATOL)
    assert_same_training(fp32, result, loss_rtol=BF16_RTOL, weight_rtol=0.0, weight_atol=BF16_WEIGHT_ATOL)
