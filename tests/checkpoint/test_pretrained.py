"""Fine-tuning from pretrained weights: each rank reads only its slices, and trains like one process's
``from_pretrained`` model.

Published Hugging Face architectures (Llama with GQA, tied and untied; GPT-2; Qwen3-MoE; BERT with a new
classification head) are saved in several safetensors shards; the user's module builds the model from its config
in ``configure_model`` and ``HybridStrategy(pretrained=dir)`` fills it. The reference is one process running
``from_pretrained`` in ``__init__`` under Lightning's DDP. After training, every run writes the model back as a
Hugging Face checkpoint from all ranks, which ``from_pretrained`` loads with the one-process fine-tune's weights.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch

from lightning_mgpu import HybridStrategy
from lightning_mgpu.checkpoint import CheckpointError
from lightning_mgpu.checkpoint.pretrained import map_weights, open_weights
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import assert_same_training
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.pretrained import FineTune, save_checkpoint, shards
from tests.helpers.tiers import case

GLOBAL_BATCH = 8
STEPS = 10
FIRST_LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-4  # AdamW turns summation-order noise on near-zero gradients into ~1e-5 steps over 10 steps

LAYOUTS = {  # name: (devices, strategy arguments)
    "dp2-z0": (2, {}),
    "dp2-z3": (2, {"zero_stage": 3}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2}),
    "cp2": (2, {"context_parallel_size": 2}),
    "ep2": (2, {"expert_parallel_size": 2}),
    "pp2-tp2": (4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
    "hsdp": (4, {"zero_stage": 3, "data_parallel_shard_size": 2}),
    "dp4-ep2": (4, {"expert_parallel_size": 2, "zero_stage": 1}),
}
DENSE = ["dp2-z0", "dp2-z3", "tp2", "pp2", "cp2", "pp2-tp2", "hsdp"]
MATRIX = {
    "llama": DENSE,
    "llama-tied": DENSE,
    "gpt2": DENSE,
    "qwen3-moe": [*DENSE, "ep2", "dp4-ep2"],
    "bert": [layout for layout in DENSE if layout != "cp2"],  # its [CLS] pooler under cp: refused (below)
    "llama+lora": ["dp2-z0", "dp2-z3", "tp2", "pp2", "pp2-tp2"],
    # The Llama's weights from the other sources: a sharded checkpoint of this strategy, a Lightning file.
    "llama@sharded": ["tp2", "pp2-tp2"],
    "llama@torch": ["dp2-z3", "pp2"],
}
# The quick tier loads every model and every layout at least once.
QUICK = {
    "llama/dp2-z0",
    "llama/dp2-z3",
    "llama/tp2",
    "llama/pp2",
    "llama/cp2",
    "llama/pp2-tp2",
    "llama/hsdp",
    "llama-tied/tp2",
    "gpt2/pp2",
    "qwen3-moe/ep2",
    "qwen3-moe/dp4-ep2",
    "bert/dp2-z3",
    "llama+lora/dp2-z3",
    "llama@sharded/tp2",
    "llama@torch/pp2",
}
CASES = [f"{model}/{layout}" for model, layouts in MATRIX.items() for layout in layouts]


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="lightning-mgpu-pretrained-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def _checkpoint(model: str) -> str:
    path = save_checkpoint(model, _root() / "pretrained")
    assert shards(path) >= 3, f"{model} was saved in {shards(path)} shards"
    return str(path)


def _tokens(batch: int) -> RandomTokenDataModule:
    return RandomTokenDataModule(batch_size=batch)


def _data_parallel(devices: int, kwargs: dict) -> int:
    split = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
    return devices // (split * kwargs.get("context_parallel_size", 1))


def _export(path: str, trainer) -> None:
    trainer.strategy.save_hf_checkpoint(path, max_shard_size="100KB")


def _module(model: str, from_pretrained: bool = False) -> partial:
    """The fine-tuning module of ``model`` (``llama+lora``: the Llama checkpoint with LoRA adapters; ``llama@...``:
    the Llama with its weights from another source)."""
    checkpoint, _, adapters = model.split("@")[0].partition("+")
    return partial(FineTune, _checkpoint(checkpoint), from_pretrained=from_pretrained, lora=adapters == "lora")


def _source(model: str) -> str:
    """Where ``model``'s pretrained weights are read from: its Hugging Face directory, or (``@sharded``, ``@torch``)
    the same weights saved by this strategy's checkpointing or as a Lightning file."""
    base, _, kind = model.partition("@")
    if not kind:
        return _checkpoint(base.partition("+")[0])
    path = _root() / f"{base}-{kind}"
    if not path.exists():
        run_distributed(_save_source, 1, _checkpoint(base), str(path), kind)
    return str(path)


def _save_source(checkpoint: str, path: str, kind: str) -> None:
    module = FineTune(checkpoint, from_pretrained=True)
    if kind == "torch":
        torch.save({"state_dict": module.state_dict(), "epoch": 0}, path)
        return
    import lightning as L

    from lightning_mgpu import HybridStrategy

    strategy = HybridStrategy(checkpoint_format="sharded")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=0, logger=False)
    trainer.fit(module, _tokens(GLOBAL_BATCH))
    trainer.save_checkpoint(path)


def _run(name: str) -> tuple[int, Run]:
    model, layout = name.split("/")
    devices, kwargs = LAYOUTS[layout]
    strict = model not in ("bert", "llama+lora")  # a new head, new adapters
    strategy = {**kwargs, "pretrained": _source(model), "pretrained_strict": strict}
    batch = GLOBAL_BATCH // _data_parallel(devices, kwargs)
    export = partial(_export, str(_root() / "export" / name.replace("/", "-")))
    run = Run(_module(model), partial(_tokens, batch), strategy, STEPS, after_fit=export)
    return devices, run


def _reference_run(model: str) -> Run:
    return Run(_module(model, from_pretrained=True), partial(_tokens, GLOBAL_BATCH), None, STEPS)


def _fits(names: set[str]) -> dict:
    by_world: dict[int, dict[str, Run]] = {}
    for name in sorted(names):
        devices, run = _run(name)
        by_world.setdefault(devices, {})[name] = run
    found: dict = {}
    for devices, runs in by_world.items():
        found.update(fit_each(runs, devices))
    return found


@functools.cache
def _trained() -> dict:
    return _fits(QUICK)


@functools.cache
def _slow_trained() -> dict:
    return _fits(set(CASES) - QUICK)


def _reference(model: str):
    return result(references({model: _reference_run(model)})[model])


@pytest.mark.parametrize("name", [case(name, id=name, slow=name not in QUICK) for name in CASES])
def test_pretrained_weights_train_like_from_pretrained_on_one_process(name):
    model, _ = name.split("/")
    reference = _reference(model)
    trained, _ = result((_trained() if name in QUICK else _slow_trained())[name])
    first, expected = trained.losses[0], reference.losses[0]
    assert abs(first - expected) <= FIRST_LOSS_RTOL * abs(expected), (first, expected)
    assert_same_training(reference, trained, weight_atol=WEIGHT_ATOL)
    # The Hugging Face checkpoint every rank wrote after training is the one-process fine-tune's model.
    exported = _root() / "export" / name.replace("/", "-")
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "config.json").is_file()
    model = model.split("@")[0]
    if model == "llama+lora":  # the base model's names for its weights, the adapters' own beside them
        _assert_adapters_exported(exported, reference.state_dict)
        return
    loaded = FineTune(str(exported), from_pretrained=True) if model != "bert" else _classifier(exported)
    state = loaded.state_dict()
    for key, value in reference.state_dict.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=WEIGHT_ATOL, msg=lambda m: f"{key}: {m}")


def _assert_adapters_exported(exported: Path, reference: dict) -> None:
    from safetensors.torch import load_file

    saved = {k: v for file in exported.glob("*.safetensors") for k, v in load_file(file).items()}
    prefix = "model.base_model.model."
    for key, value in reference.items():
        name = key[len(prefix) :].replace(".base_layer", "")
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=WEIGHT_ATOL, msg=lambda m: f"{key}: {m}")
    base = FineTune(str(exported), from_pretrained=True).model  # from_pretrained reads the base weights
    torch.testing.assert_close(base.model.norm.weight, reference[prefix + "model.norm.weight"], rtol=0, atol=0)


def _classifier(path: Path) -> FineTune:
    """The exported classifier loaded as the fine-tuned one (its directory is not named ``bert``)."""
    module = FineTune(str(path))
    module.classifier = True
    module.model = module._model_class().from_pretrained(path, **module._extra())
    return module


# ------------------------------------------------------------------------------------------- names, without ranks
def test_names_match_through_the_module_prefix_and_hugging_face_conversions():
    # self.model holds the Hugging Face model: its names are the checkpoint's under "model."
    module = FineTune(_checkpoint("qwen3-moe"))
    with torch.device("meta"):
        module.configure_model()
    weights = map_weights(module, open_weights(_checkpoint("qwen3-moe")))
    assert weights.prefixes == ("model.", "")
    assert not weights.missing and not weights.unexpected
    # Per-expert tensors stacked into the fused expert weight, gate and up concatenated (Hugging Face's conversion).
    parts = weights.parts["model.model.layers.0.mlp.experts.gate_up_proj"]
    assert [(p.name.split("experts.")[1], p.offsets, p.stack_dim) for p in parts][:3] == [
        ("0.gate_proj.weight", (0, 0, 0), 0),
        ("1.gate_proj.weight", (1, 0, 0), 0),
        ("2.gate_proj.weight", (2, 0, 0), 0),
    ]
    assert parts[4].name.endswith("experts.0.up_proj.weight") and parts[4].offsets == (0, 32, 0)


def test_a_tied_head_reads_the_embedding_and_a_new_head_is_named():
    tied = FineTune(_checkpoint("llama-tied"))
    with torch.device("meta"):
        tied.configure_model()
    weights = map_weights(tied, open_weights(_checkpoint("llama-tied")))
    assert weights.direct["model.lm_head.weight"] == "model.embed_tokens.weight"
    classifier = FineTune(_checkpoint("bert"))
    with torch.device("meta"):
        classifier.configure_model()
    with pytest.raises(CheckpointError, match=r"no entry for 4 .*model\.classifier\.weight.*pretrained_strict=False"):
        map_weights(classifier, open_weights(_checkpoint("bert")))
    weights = map_weights(classifier, open_weights(_checkpoint("bert")), strict=False)
    assert set(weights.missing) == {
        "model.bert.pooler.dense.weight",
        "model.bert.pooler.dense.bias",
        "model.classifier.weight",
        "model.classifier.bias",
    }
    assert weights.prefixes == ("model.", "") and all(name.startswith("cls.") for name in weights.unexpected)


def test_sources_and_their_errors(tmp_path):
    llama = Path(_checkpoint("llama"))
    assert open_weights(llama).kind == "Hugging Face"
    with pytest.raises(CheckpointError, match=r"one file of .* pass the directory"):
        open_weights(next(llama.glob("*.safetensors")))
    with pytest.raises(CheckpointError, match="no such file"):
        open_weights(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="holds neither"):
        open_weights(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="lists shards that are missing"):
        open_weights(broken)
    file = tmp_path / "weights.pt"
    module = FineTune(str(llama), from_pretrained=True)
    torch.save({"state_dict": module.state_dict(), "epoch": 0}, file)
    source = open_weights(file)
    assert source.kind == "torch file" and set(source.entries) == set(module.state_dict())
    assert map_weights(module, source).prefixes == ("", "")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="neither a state dict nor a Lightning checkpoint"):
        open_weights(tmp_path / "list.pt")


def test_shapes_that_differ_are_refused_by_name():
    module = FineTune(_checkpoint("llama"))
    source = open_weights(_checkpoint("llama"))
    source.entries["model.norm.weight"] = (65,)
    with torch.device("meta"):
        module.configure_model()
    with pytest.raises(CheckpointError, match=r"model\.model\.norm\.weight is \[64\] in the model, \[65\]"):
        map_weights(module, source)


def test_a_missing_path_is_refused_when_the_strategy_is_built(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"absent.*no such file"):
        HybridStrategy(pretrained=tmp_path / "absent")


def test_lora_layers_read_their_base_weights_and_name_only_the_adapters_as_new():
    module = FineTune(_checkpoint("llama"), lora=True)
    with torch.device("meta"):
        module.configure_model()
    weights = map_weights(module, open_weights(_checkpoint("llama")), strict=False)
    key = "model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert weights.direct[key] == "model.layers.0.self_attn.q_proj.weight"
    assert weights.missing and all(".lora_" in name for name in weights.missing)
    assert not weights.unexpected


# ------------------------------------------------------------------------------------------------ host memory
def _memory_checkpoint() -> str:
    """A ~100 MB Llama (fp32) in 30 MB shards: big enough that a rank's share stands out of the process's noise."""
    from transformers import LlamaForCausalLM

    from tests.helpers.pretrained import mid_llama_config

    path = _root() / "memory-llama"
    if not (path / "config.json").is_file():
        LlamaForCausalLM(mid_llama_config(8000)).save_pretrained(path, max_shard_size="30MB")
    return str(path)


@functools.cache
def _setup_memory() -> dict[str, list[dict]]:
    from tests.helpers.distributed import run_distributed
    from tests.helpers.pretrained import setup_memory

    path = _memory_checkpoint()
    layouts = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
    return {name: run_distributed(setup_memory, 2, path, kwargs, True) for name, kwargs in layouts.items()}


def _above_baseline(rank: dict) -> int:
    return (rank["peak_kib"] - rank["baseline_kib"]) * 1024


@pytest.mark.slow  # three 2-rank fits of a ~100 MB model
def test_each_rank_holds_its_share_while_loading_not_the_model():
    """A ~100 MB Llama at tp 2 and at pp 2: each rank's peak host memory during setup stays within 1.3 x its share
    + the largest tensor, above the process's baseline (at pp 2 the whole model on a rank would exceed it). The
    benchmark prints from_pretrained in __init__ beside it."""
    for name, ranks in _setup_memory().items():
        for rank in ranks:
            bound = 1.3 * rank["held_bytes"] + rank["largest_bytes"]
            assert _above_baseline(rank) <= bound, (name, _above_baseline(rank) / 2**20, bound / 2**20, rank)
            if name == "pp2":
                assert bound < open_weights(_memory_checkpoint()).bytes_of()  # the whole model would not fit under it


def test_a_classifier_on_a_pooled_token_is_refused_under_context_parallelism():
    """BERT's classification head reads the [CLS] token: split over cp ranks, each would see its own shard's."""
    _, run = _run("bert/dp2-z0")
    strategy = {**run.strategy_kwargs, "context_parallel_size": 2}
    failed = _failure_of(fit_each({"cp": Run(run.module_factory, partial(_tokens, 8), strategy, 1)}, 2)["cp"])
    assert "one target per sequence (shape [8])" in failed and "BERT's [CLS]" in failed, failed


def _failure_of(outcome) -> str:
    assert isinstance(outcome, str), "the run trained"
    return outcome
