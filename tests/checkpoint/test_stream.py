"""``lightning-mgpu consolidate`` tensor by tensor: the same file as consolidating in memory, and a process that
holds the largest tensor, not the model.

A ~100 MB Llama trained one step under ``HybridStrategy`` saves a sharded checkpoint (weights and AdamW state:
~300 MB); a fresh process writes it as a torch file and as safetensors. Their contents equal ``consolidate``'s
(in memory); the process's peak resident memory above its baseline stays under three of its largest tensors.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import torch

from lightning_mgpu.checkpoint import consolidate, write_consolidated
from tests.helpers.distributed import run_distributed
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.pretrained import mid_llama_config
from tests.helpers.probes import reset_peak_rss, status_kib

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class _Llama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(mid_llama_config(2000))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _save(directory: str) -> str:
    from lightning_mgpu import HybridStrategy

    strategy = HybridStrategy(checkpoint_format="sharded")
    trainer = L.Trainer(devices=1, strategy=strategy, max_steps=1, enable_checkpointing=False, **QUIET)
    trainer.fit(_Llama(), RandomTokenDataModule(vocab_size=2000, batch_size=1, num_samples=2, seq_len=8))
    path = f"{directory}/sharded.ckpt"
    trainer.save_checkpoint(path)
    return path


def _write(checkpoint: str, out: str, out_format: str) -> int:
    """Peak resident memory above the baseline, in bytes, while ``consolidate`` writes ``out``."""
    import torch.distributed.checkpoint  # noqa: F401  # modules the write imports: code, not data
    from torch._subclasses import fake_tensor  # noqa: F401

    # A first write pays what is paid once per process (imports, lazily built caches: ~30 MiB measured, above the
    # bound); the second is measured. Memory freed by the first and kept by the allocator is a few MiB at most,
    # against the 104 MiB a write that held the model would need.
    write_consolidated(Path(checkpoint), Path(out + ".warm"), out_format)
    baseline = status_kib("VmRSS")
    reset_peak_rss()
    write_consolidated(Path(checkpoint), Path(out), out_format)
    return (status_kib("VmHWM") - baseline) * 1024


@functools.cache
def _written(directory: str) -> dict:
    checkpoint = run_distributed(_save, 1, directory)[0]
    peaks = {
        fmt: run_distributed(_write, 1, checkpoint, f"{directory}/out.{fmt}", fmt)[0]
        for fmt in ("torch", "safetensors")
    }
    return {"checkpoint": checkpoint, "peaks": peaks}


def test_streamed_files_hold_what_consolidating_in_memory_gives(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("stream"))
    out = _written(root)
    expected = consolidate(Path(out["checkpoint"]))
    written = torch.load(f"{root}/out.torch", weights_only=True)
    assert set(written) == set(expected)
    torch.testing.assert_close(written["state_dict"], expected["state_dict"], rtol=0, atol=0)
    torch.testing.assert_close(written["optimizer_states"], expected["optimizer_states"], rtol=0, atol=0)
    assert written["global_step"] == expected["global_step"] == 1
    from safetensors.torch import load_file

    weights = load_file(f"{root}/out.safetensors")  # Hugging Face names: the model's prefix stripped
    assert set(weights) == {key[len("model.") :] for key in expected["state_dict"]}
    for key, value in weights.items():
        assert torch.equal(value, expected["state_dict"]["model." + key]), key


def test_streaming_holds_the_largest_tensor_not_the_model(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("stream"))
    out = _written(root)
    state = consolidate(Path(out["checkpoint"]))["state_dict"]
    largest = max(t.numel() * t.element_size() for t in state.values())
    model = sum(t.numel() * t.element_size() for t in state.values())
    assert model > 20 * largest  # the bound below can tell the two apart
    for fmt, peak in out["peaks"].items():
        assert peak <= 3 * largest + 16 * 2**20, (fmt, peak, largest, model)
        print(
            f"{fmt}: peak {peak / 2**20:.1f} MiB above the baseline, largest tensor {largest / 2**20:.1f} MiB,"
            f" model {model / 2**20:.1f} MiB"
        )
