"""Published Hugging Face architectures saved as sharded pretrained checkpoints, and a user's fine-tuning module.

The checkpoints are written the way a user gets them: ``save_pretrained`` of a model built from a small config
(random weights: there is no download here), cut into several safetensors shards with their index. The module is
what a user writes: the Hugging Face model built from its config in ``configure_model`` (the scalable way, with
``HybridStrategy(pretrained=...)``), or loaded with ``from_pretrained`` in ``__init__`` (the small way, and the
one-process reference). Nothing in either is changed for the library.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

NUM_LABELS = 3


def mid_llama_config(vocab_size: int) -> Any:
    """A Llama of ~25M parameters plus its embeddings (8 layers of width 512, GQA, untied head): large enough that
    memory measurements stand out of a process's noise, small enough for a test."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


def configs() -> dict[str, Any]:
    """Small configs of the architectures the pretrained path is held to, options at their defaults but dropout,
    which is off so that runs on different layouts (each drawing its own masks) compare step by step."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, Qwen3MoeConfig

    llama = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return {
        "llama": LlamaConfig(**llama, tie_word_embeddings=False),
        "llama-tied": LlamaConfig(**llama, tie_word_embeddings=True),
        "gpt2": GPT2Config(
            vocab_size=128,
            n_positions=64,
            n_embd=64,
            n_layer=4,
            n_head=4,
            n_inner=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "qwen3-moe": Qwen3MoeConfig(
            **{**llama, "intermediate_size": 128},
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
        ),
        "bert": BertConfig(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
    }


def save_checkpoint(name: str, directory: Path, seed: int = 0, shard_bytes: str = "100KB") -> Path:
    """``name``'s model saved with ``save_pretrained`` in several shards (BERT as its masked-LM pretraining model,
    so that a classifier fine-tuned from it has a new head)."""
    from transformers import AutoModelForCausalLM, BertForMaskedLM

    path = directory / name
    if (path / "config.json").is_file():
        return path
    config = configs()[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertForMaskedLM(config) if name == "bert" else AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, max_shard_size=shard_bytes)
    return path


def shards(path: Path) -> int:
    return sum(1 for _ in Path(path).glob("*.safetensors"))


class FineTune(L.LightningModule):
    """A user's fine-tuning module: a causal LM on next-token targets, or (``bert``) a sequence classifier with a
    new head on the first target token's class."""

    def __init__(self, path: str, from_pretrained: bool = False, lr: float = 1e-3, lora: bool = False) -> None:
        super().__init__()
        self.path, self.lr, self.lora = path, lr, lora
        self.classifier = os.path.basename(path.rstrip("/")) == "bert"
        if from_pretrained:
            self.model = self._with_adapters(self._model_class().from_pretrained(path, **self._extra()))

    def _with_adapters(self, model: Any) -> Any:
        """With ``lora``: LoRA adapters (``peft``) on the attention projections, the rest frozen."""
        if not self.lora:
            return model
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    def _model_class(self) -> Any:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        return AutoModelForSequenceClassification if self.classifier else AutoModelForCausalLM

    def _extra(self) -> dict[str, Any]:
        return {"num_labels": NUM_LABELS} if self.classifier else {}

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path, **self._extra())
        self.model = self._with_adapters(self._model_class().from_config(config))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        if self.classifier:
            return F.cross_entropy(logits, y[:, 0] % NUM_LABELS)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def setup_memory(path: str, strategy_kwargs: dict[str, Any], scalable: bool) -> dict[str, Any]:
    """In a rank: the peak resident memory above the process's baseline while a one-step fine-tune of ``path`` sets
    up, the small way (``from_pretrained`` in ``__init__``) or the scalable one (``pretrained=``), with what the
    rank holds then. A first fit of a tiny model puts the process group's, Lightning's and DTensor's first-use
    costs in the baseline."""
    import gc

    from transformers import AutoConfig

    from lightning_mgpu import HybridStrategy
    from tests.helpers.modules import LlamaModule, RandomTokenDataModule
    from tests.helpers.probes import SetupMemory, reset_peak_rss, status_kib

    quiet = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
             "enable_model_summary": False}  # fmt: skip
    devices = int(os.environ["WORLD_SIZE"])
    vocab = AutoConfig.from_pretrained(path).vocab_size
    warm = L.Trainer(devices=devices, strategy=HybridStrategy(**strategy_kwargs), max_steps=1, **quiet)
    warm.fit(LlamaModule(vocab_size=vocab), RandomTokenDataModule(vocab_size=vocab, batch_size=1, num_samples=8))
    gc.collect()
    baseline = status_kib("VmRSS")
    reset_peak_rss()
    memory = SetupMemory()
    module = FineTune(path, from_pretrained=not scalable)
    strategy = HybridStrategy(pretrained=path if scalable else None, **strategy_kwargs)
    trainer = L.Trainer(devices=devices, strategy=strategy, max_steps=1, callbacks=[memory], **quiet)
    trainer.fit(module, RandomTokenDataModule(vocab_size=vocab, batch_size=1, num_samples=8, seq_len=16))
    return {"baseline_kib": baseline, **memory.results}
