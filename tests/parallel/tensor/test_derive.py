"""``tp_plan="auto"`` for models without a plan (issue 11, item 3): BERT and ViT shard from their blocks' data flow.

The models are Hugging Face's classes as shipped, built from tiny configurations with random weights, inside
LightningModules written the way a user writes them (the loss from the model's own ``labels=``).
"""

from __future__ import annotations

import ast
import logging
import re
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mgpu.parallel.tensor.derive import derive_block_plan
from lightning_mgpu.parallel.tensor.plan import _block_rules, _match, auto_plan
from lightning_mgpu.parallel.tensor.sharding import _global_shape_regions
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import assert_same_training
from tests.helpers.modules import RandomImageDataModule, RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule

transformers = pytest.importorskip("transformers")

STEPS = 10
GLOBAL_BATCH = 8
TP_WEIGHT_ATOL = 1e-4  # as in test_tensor.py: AdamW turns reduction-order noise on near-zero gradients into ~1e-5
VOCAB, CLASSES = 128, 10


def _bert_config(**overrides: Any) -> Any:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    return transformers.BertConfig(**{**settings, **overrides})


class BertMaskedLM(L.LightningModule):
    """BERT pre-training's masked-LM objective (the decoder tied to the word embeddings, as BERT ships)."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.model = transformers.BertForMaskedLM(_bert_config(**config))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        labels = targets.masked_fill(targets % 4 != 0, -100)  # predict a quarter of the positions
        loss = self.model(input_ids=tokens, labels=labels).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class BertClassifier(L.LightningModule):
    """Sequence classification from BERT's pooled ``[CLS]`` (the label: a function of the first target token)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.BertForSequenceClassification(_bert_config())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = self.model(input_ids=tokens, labels=targets[:, 0] % CLASSES).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ViTClassifier(L.LightningModule):
    """ViT image classification on 16x16 images in 4x4 patches."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=CLASSES,
        )
        self.model = transformers.ViTForImageClassification(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = self.model(pixel_values=images, labels=labels).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _tokens(batch: int) -> RandomTokenDataModule:
    return RandomTokenDataModule(vocab_size=VOCAB, batch_size=batch)


def _images(batch: int) -> RandomImageDataModule:
    return RandomImageDataModule(num_classes=CLASSES, batch_size=batch)


BERT_PLAN = {
    "model.bert.encoder.layer.*.attention.self.query": "colwise",
    "model.bert.encoder.layer.*.attention.self.key": "colwise",
    "model.bert.encoder.layer.*.attention.self.value": "colwise",
    "model.bert.encoder.layer.*.attention.output.dense": "rowwise",
    "model.bert.encoder.layer.*.intermediate.dense": "colwise",
    "model.bert.encoder.layer.*.output.dense": "rowwise",
}


# ------------------------------------------------------------------------------------------------ derivation
def test_bert_plan_is_derived_from_the_data_flow_and_logged(caplog):
    module = BertMaskedLM()
    state = torch.random.get_rng_state()
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # printed like Lightning's own info
    lightning_log.addHandler(caplog.handler)
    try:
        plan = auto_plan(module)
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert plan == BERT_PLAN
    assert torch.equal(state, torch.random.get_rng_state())  # the trace draws no random numbers
    logged = re.search(r"pin it: (\{.*\})", caplog.text)
    assert logged and ast.literal_eval(logged.group(1)) == BERT_PLAN  # copyable as an explicit tp_plan
    assert auto_plan(BertClassifier()) == BERT_PLAN
    # BERT declares no Hugging Face plan: its code runs on global shapes (view(*input_shape, -1, head_size) untouched),
    # the attention between q/k/v and the output dense, the whole layer between intermediate and output dense.
    regions = set(_global_shape_regions(module, _match(module, plan)).values())
    assert regions == {f"model.bert.encoder.layer.{i}{part}" for i in (0, 1) for part in ("", ".attention")}


def test_roberta_is_derived_like_bert():
    config = transformers.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    plan = auto_plan(transformers.RobertaForMaskedLM(config))
    assert plan == {glob.replace("model.bert.", "roberta."): s for glob, s in BERT_PLAN.items()}


@pytest.mark.parametrize(
    ("factory", "blocks"),
    [
        (ViTClassifier, "model.vit.layers"),
        (NanoGPTModule, "model.transformer.h"),
        (
            lambda: transformers.DeiTForImageClassification(
                transformers.DeiTConfig(
                    image_size=16,
                    patch_size=4,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=64,
                )
            ),
            "deit.layers",
        ),
        (
            lambda: transformers.GPT2LMHeadModel(
                transformers.GPT2Config(
                    n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
                )
            ),
            "transformer.h",
        ),
    ],
    ids=["vit", "nanogpt", "deit", "gpt2-conv1d"],
)
def test_derivation_agrees_with_the_gpt_block_name_rules(factory, blocks):
    """Where the name rules know every layer, the data flow gives the same plan (fused q|k|v included), without
    reading a name: ViT's q/k/v/o_proj and fc1/fc2, nanoGPT's split c_attn, GPT-2's transposed Conv1D."""
    module = factory()
    assert derive_block_plan(module, blocks) == _block_rules(module, blocks)


class _Bottleneck(nn.Module):
    """A residual MLP with a projection between two others: no column/row pair can split it."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.widen = nn.Linear(width, 4 * width)
        self.mix = nn.Linear(4 * width, 4 * width)
        self.narrow = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.narrow(torch.relu(self.mix(torch.relu(self.widen(self.norm(x))))))


class _BottleneckModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([_Bottleneck(), _Bottleneck()])


def test_an_underivable_block_fails_with_the_plan_to_pass():
    model = _BottleneckModel()
    with pytest.raises(ValueError, match=r"blocks\.0\.mix: sits between other projections") as error:
        auto_plan(model)
    explicit = ast.literal_eval(re.search(r"tp_plan=(\{.*\})", str(error.value)).group(1))
    # No column/row pair is left around `mix`: the plan offered keeps the block whole, which always trains.
    assert explicit == {"blocks.*.widen": "replicate", "blocks.*.mix": "replicate", "blocks.*.narrow": "replicate"}
    assert "blocks.0.narrow: writes into the residual stream, but reads more than column-parallel" in str(error.value)
    assert set(_match(model, explicit)) == {f"blocks.{i}.{n}" for i in (0, 1) for n in ("widen", "mix", "narrow")}


class _NeedsRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 64)
        self.outer = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        return x + self.outer(self.inner(x) * cos)


def test_a_block_that_cannot_be_traced_fails_with_a_plan_by_shapes():
    model = nn.Module()
    model.blocks = nn.ModuleList([_NeedsRotary(), _NeedsRotary()])
    with pytest.raises(ValueError, match=r"on hidden states of width 16 alone failed.*Pass `tp_plan` as a dict") as e:
        auto_plan(model)
    assert "tp_plan={'blocks.*.inner': 'colwise', 'blocks.*.outer': 'rowwise'}" in str(e.value)


# ------------------------------------------------------------------------------------------------ training
class _ShardedParameters(L.Callback):
    """Which parameters tensor parallelism split (a DTensor placed other than replicated), as training starts."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        self.results["sharded"] = sorted(
            name
            for name, p in pl_module.named_parameters()
            if isinstance(p, DTensor) and not all(placement.is_replicate() for placement in p.placements)
        )


def _split_by_plan(prefix: str, colwise: tuple[str, ...], rowwise: tuple[str, ...]) -> list[str]:
    """Megatron's split: column-parallel weights and biases, row-parallel weights (their bias stays whole)."""
    names = [f"{prefix}.{i}.{n}.{p}" for i in (0, 1) for n in colwise for p in ("weight", "bias")]
    return sorted(names + [f"{prefix}.{i}.{n}.weight" for i in (0, 1) for n in rowwise])


BERT_SPLIT = _split_by_plan(
    "model.bert.encoder.layer",
    ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
    ("attention.output.dense", "output.dense"),
)
VIT_SPLIT = _split_by_plan(
    "model.vit.layers",
    ("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
    ("attention.o_proj", "mlp.fc2"),
)


class _SaveAtTheEnd(L.Callback):
    def __init__(self, path: Any) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _check_consolidation(ckpt: Any, reference: Any, directory: Any) -> None:
    """The tp=2 checkpoint, consolidated by `lightning-mgpu consolidate`, loads strictly into the unmodified module
    in this one process with the reference's weights, and as safetensors under Hugging Face's names."""
    from safetensors.torch import load_file

    from lightning_mgpu.cli import main as cli

    assert cli(["consolidate", str(ckpt), str(directory / "full.ckpt")]) == 0
    module = BertMaskedLM()
    module.load_state_dict(torch.load(directory / "full.ckpt", weights_only=True)["state_dict"], strict=True)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict[name], rtol=1e-4, atol=TP_WEIGHT_ATOL, msg=name)
    hf_dir = directory / "hf"
    assert cli(["consolidate", str(ckpt), str(hf_dir / "model.safetensors"), "--format", "safetensors"]) == 0
    names = set(load_file(hf_dir / "model.safetensors"))
    assert "bert.encoder.layer.0.attention.self.query.weight" in names and names <= set(module.model.state_dict())
    loaded = transformers.BertForMaskedLM.from_pretrained(hf_dir)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, module.model(input_ids=tokens).logits)


CASES = [  # (name, module factory, data, devices, dp, strategy arguments, parameters split over tp or None)
    ("bert-mlm-tp2", BertMaskedLM, _tokens, 2, 1, {"tensor_parallel_size": 2}, BERT_SPLIT),
    ("vit-tp2", ViTClassifier, _images, 2, 1, {"tensor_parallel_size": 2}, VIT_SPLIT),
    ("bert-classifier-dp2-tp2-z1", BertClassifier, _tokens, 4, 2, {"tensor_parallel_size": 2, "zero_stage": 1}, None),
    (
        "bert-classifier-tp2-sp",
        BertClassifier,
        _tokens,
        2,
        1,
        {"tensor_parallel_size": 2, "sequence_parallel": True},
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "factory", "data", "devices", "dp", "strategy", "split"), CASES, ids=[c[0] for c in CASES]
)
def test_derived_plans_train_like_one_process(name, factory, data, devices, dp, strategy, split, derived, tmp_path):
    trained, _ = result(derived["trained"][name])
    reference = result(derived["references"][factory.__name__])
    assert_same_training(reference, trained, weight_atol=TP_WEIGHT_ATOL)
    if split is not None:
        assert trained.extra["sharded"] == split
    if factory is BertMaskedLM:
        _check_consolidation(derived["directory"] / f"{name}.ckpt", reference, tmp_path)


@pytest.fixture(scope="module")
def derived(tmp_path_factory: Any) -> dict[str, Any]:
    """Every case's run (one job per world size, each saving its checkpoint at the end) and every model's
    one-process reference (one job)."""
    directory = tmp_path_factory.mktemp("derived")
    by_devices: dict[int, dict[str, Run]] = {2: {}, 4: {}}
    for name, factory, data, devices, dp, strategy, _ in CASES:
        by_devices[devices][name] = Run(
            factory,
            lambda d=data, b=GLOBAL_BATCH // dp: d(b),
            {**strategy, "tp_plan": "auto"},
            callbacks_factory=lambda p=directory / f"{name}.ckpt": [_ShardedParameters(), _SaveAtTheEnd(p)],
        )
    trained = {name: r for devices, runs in by_devices.items() for name, r in fit_each(runs, devices, 900).items()}
    models = {factory.__name__: (factory, data) for _, factory, data, *_ in CASES}
    runs = {name: Run(factory, lambda d=data: d(GLOBAL_BATCH)) for name, (factory, data) in models.items()}
    return {"trained": trained, "references": references(runs), "directory": directory}


def test_sequence_parallel_without_a_token_embedding_fails_before_training():
    """ViT's stream starts at a patch convolution: nothing splits it over the sequence, so sequence parallelism
    is refused by name (tensor parallelism alone trains it, above)."""
    with pytest.raises(ValueError, match=r"sequence_parallel=True .* this model has none .* without sequence_parallel"):
        auto_plan(ViTClassifier(), sequence_parallel=True)


def _tp2_worker(refused: list[tuple[Any, bool]]) -> dict[str, Any]:
    """On a tp=2 mesh: each refused case's error, and the collectives of one BERT forward/backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    errors = []
    for factory, sequence_parallel in refused:
        try:
            apply_tensor_parallel(factory(), mesh, "auto", sequence_parallel)
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
    bert = BertMaskedLM()
    apply_tensor_parallel(bert, mesh, "auto", False)
    tokens = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    with CommDebugMode() as comm:
        bert.model(input_ids=tokens, labels=tokens).loss.backward()
    return {"errors": errors, "collectives": {str(op): n for op, n in comm.get_comm_counts().items()}}


def _three_heads() -> L.LightningModule:
    return BertMaskedLM(hidden_size=24, num_attention_heads=3, intermediate_size=48)


@pytest.fixture(scope="module")
def tp2_probe() -> dict[str, Any]:
    return run_distributed(_tp2_worker, 2, [(_three_heads, False), (BertMaskedLM, True)], timeout=120)[0]


def test_encoders_that_cannot_be_sharded_fail_before_training_saying_why(tp2_probe):
    """Heads not divisible by the degree name the valid degrees. BERT's masked-LM decoder is tied to the word
    embedding, which sequence parallelism shards over the vocabulary to split the stream: refused naming both."""
    heads, tied = tp2_probe["errors"]
    assert re.search(r"tensor_parallel_size=2 must divide.*attention.self.num_attention_heads = 3", heads), heads
    assert "Valid tensor_parallel_size values for this model and plan: [3]" in heads, heads
    assert re.search(r"word_embeddings.weight and model.cls.predictions.decoder.weight are one tied weight", tied), tied


def test_bert_in_global_shape_regions_communicates_like_megatron(tp2_probe):
    """BERT's attention and layers run on global-shape DTensors, yet a forward/backward costs Megatron-LM's count:
    per layer one all-reduce after the attention and one after the MLP, the same two for the input gradients
    (q/k/v share one), and nothing else (no gather of a reshape, mask or attention)."""
    assert tp2_probe["collectives"] == {"c10d_functional.all_reduce": 4 * 2}
