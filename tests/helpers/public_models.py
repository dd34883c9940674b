"""Public model code as its packages ship it, each in the minimal LightningModule a user would write around it.

The rule of this file: a model is built with its package's defaults. Only sizes are shrunk (layers, widths, heads,
vocabulary: the tiny configs the packages' own tests use), and dropout is set to 0 where a case compares against one
process (``dropout=0.0`` below; no parallel layout reproduces one process's random masks). Nothing else is set to
make the library work: ``use_cache``, tied embeddings, attention implementation, norms and init stay as shipped. A
helper that sets an option because the library needs it is a test bug: the library is what must change.

Three of the packages cannot go into the environment with their dependencies, so ``public_packages`` installs them
with ``--no-deps`` into a folder of their own, appended to ``sys.path`` (the environment's packages win):

- timm imports torchvision, and the index's torchvision wheel is a CUDA build whose compiled operators cannot load
  beside the CPU torch these machines run (``torchvision::nms`` does not exist). In the environment, torchmetrics
  and so Lightning itself would import it and fail. Its Python code registers fake kernels for two operators; they
  are declared here without kernels: the models here never call them, and a call would fail loudly ("no kernel").
- litgpt pins ``huggingface-hub<1.4`` and ``jsonargparse<=4.41``, which transformers 5.23 and our CLI exclude; the
  model code imports neither.

torchtitan installs normally (the dev extra), 0.2: 0.3 dropped SDPA for its language models, and its flex attention
has no backward on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from filelock import FileLock
from torch import nn

VOCAB = 128
SEQUENCE = 32
IMAGE = 32
CLASSES = 10
# The releases paired with torch 2.13 and transformers 5.23 (see the module docstring).
PUBLIC_PACKAGES = ("timm==1.0.31", "torchvision==0.28.0", "litgpt==0.5.13")
_PACKAGES_DIR = Path(os.environ.get("LIGHTNING_MGPU_MODELS_DIR", Path.home() / ".cache/lightning-mgpu/public-models"))


def public_packages() -> None:
    """Make timm and litgpt importable (installed once per machine, see the module docstring)."""
    marker = _PACKAGES_DIR / ".installed"
    with FileLock(str(_PACKAGES_DIR) + ".lock"):  # two test workers may ask at once
        if not marker.exists() or marker.read_text() != " ".join(PUBLIC_PACKAGES):
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(_PACKAGES_DIR)]
            done = subprocess.run([*command, *PUBLIC_PACKAGES], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise ImportError(f"`{' '.join(command + list(PUBLIC_PACKAGES))}` failed:\n{done.stderr}")
            marker.write_text(" ".join(PUBLIC_PACKAGES))
    for name in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # declared already (an earlier call in this process)
            pass
    if str(_PACKAGES_DIR) not in sys.path:
        sys.path.append(str(_PACKAGES_DIR))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class _Trained(L.LightningModule):
    """The user's loop: AdamW over every parameter, the loss logged as ``train_loss``."""

    model: nn.Module

    def __init__(self, lr: float = 1e-3, sgd: bool = False) -> None:
        super().__init__()
        self.lr = lr
        self.sgd = sgd

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:  # how ResNets are trained; AdamW would turn reduction-order noise into lr-sized steps
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def _log_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.log("train_loss", loss, sync_dist=True)
        return loss


# ------------------------------------------------------------------------------------------------------ timm
class TimmClassifier(_Trained):
    """A timm image model by name (``timm.create_model``), shrunk by ``sizes``; labels from 10 classes."""

    def __init__(self, name: str, dropout: float | None = None, sgd: bool = False, **sizes: Any) -> None:
        super().__init__(lr=0.01 if sgd else 1e-3, sgd=sgd)
        options = dict(sizes)
        if dropout is not None:
            options.update(drop_rate=dropout, drop_path_rate=dropout)
        public_packages()
        import timm

        self.model = timm.create_model(name, num_classes=CLASSES, **options)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return self._log_loss(F.cross_entropy(self.model(images), labels))


# ------------------------------------------------------------------------------------------------------ litgpt
class LitGPTModule(_Trained):
    """litgpt's ``GPT`` from its ``Config`` (its defaults: LayerNorm, parallel residual, bias, GeLU MLP)."""

    def __init__(self, n_query_groups: int = 4, **config: Any) -> None:
        super().__init__()
        public_packages()
        from litgpt.config import Config
        from litgpt.model import GPT

        sizes = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB)
        self.model = GPT(Config(n_query_groups=n_query_groups, **{**sizes, **config}))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self._log_loss(_lm_loss(self.model(x), y))


# ------------------------------------------------------------------------------------------------ Hugging Face
# Size fields shrunk where a configuration class has them; everything else is the class's default.
_HF_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    # GPT-2 and T5 name theirs differently
    n_positions=64,
    n_embd=64,
    n_layer=2,
    n_head=4,
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_heads=4,
)
_HF_DROPOUTS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout_rate",
    "attention_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
    "activation_dropout",
)


# The token ids a tokenizer would give (a pretrained checkpoint's config has them; T5's default config has no
# ``decoder_start_token_id``, without which it cannot train on ``labels`` even in one process).
_HF_TOKENS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def hf_config(model_type: str, dropout: float | None = None) -> Any:
    """The configuration class of ``model_type`` with its defaults, only the sizes above shrunk."""
    from transformers import AutoConfig

    config_class = type(AutoConfig.for_model(model_type))
    defaults = config_class()
    sizes = {k: v for k, v in _HF_SIZES.items() if hasattr(defaults, k)}
    sizes.update(_HF_TOKENS)
    if dropout is not None:
        sizes.update({k: dropout for k in _HF_DROPOUTS if hasattr(defaults, k)})
    return config_class(**sizes)


class HFCausalLM(_Trained):
    """``AutoModelForCausalLM.from_config`` of a tiny default config; the user computes the loss from ``.logits``."""

    def __init__(self, model_type: str, dropout: float | None = None) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(hf_config(model_type, dropout))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self._log_loss(_lm_loss(self.model(input_ids=x).logits, y))


class HFSeq2SeqLM(_Trained):
    """An encoder-decoder (T5, BART) with ``labels``: the model shifts them into decoder inputs and returns the loss."""

    def __init__(self, model_type: str, dropout: float | None = None) -> None:
        super().__init__()
        from transformers import AutoModelForSeq2SeqLM

        self.model = AutoModelForSeq2SeqLM.from_config(hf_config(model_type, dropout))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self._log_loss(self.model(input_ids=x, labels=y).loss)


class HFMaskedLM(_Trained):
    """An encoder (BERT) trained on predicting every next token from its position: ``AutoModelForMaskedLM``."""

    def __init__(self, model_type: str, dropout: float | None = None) -> None:
        super().__init__()
        from transformers import AutoModelForMaskedLM

        self.model = AutoModelForMaskedLM.from_config(hf_config(model_type, dropout))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self._log_loss(_lm_loss(self.model(input_ids=x).logits, y))


# ------------------------------------------------------------------------------------------------------ torchtitan
class TorchTitanLlama(_Trained):
    """torchtitan's Llama 3 ``Transformer`` from its ``TransformerModelArgs`` (defaults but sizes; blocks in an
    ``nn.ModuleDict``), initialised by its own ``init_weights`` as torchtitan's trainer does."""

    def __init__(self, n_kv_heads: int | None = 2, **args: Any) -> None:
        super().__init__()
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer

        sizes = dict(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=64)
        self.model = Transformer(TransformerModelArgs(n_kv_heads=n_kv_heads, **{**sizes, **args}))
        with torch.no_grad():  # as torchtitan's trainer calls it
            self.model.init_weights()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self._log_loss(_lm_loss(self.model(x), y))
