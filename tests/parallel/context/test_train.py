"""Context parallelism on public model code as published: every layout trains like one process.

nanoGPT (learned positions, causal SDPA) and a Hugging Face Llama (rotary position ids, grouped-query attention),
each sequence split over cp ranks, against the same model trained on one process: per-step losses within 1e-5
relative, weights within 1e-4 (fp32); bf16-mixed within 2e-2 of one process in bf16-mixed.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_mgpu import HybridStrategy
from lightning_mgpu.layout import CP_AXIS
from lightning_mgpu.parallel.context import check_module
from tests.helpers import public_models as pm
from tests.helpers import tiers
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule
from tests.helpers.probes import CollectiveCounter

STEPS = 10
GLOBAL_BATCH = 8
WEIGHT_ATOL = 1e-4
BF16_RTOL = 2e-2


class PaddedTokens(RandomTokenDataModule):
    """Right-padded sequences: each sample's last 0-12 targets are the ignore index, so the cp shards of one
    sequence hold different numbers of counted tokens (a per-shard mean would weight them wrongly)."""

    def __init__(self, ignore_index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        x, y = self.train_data.tensors
        g = torch.Generator().manual_seed(7)
        pad = torch.randint(0, 13, (len(y),), generator=g)
        positions = torch.arange(y.shape[1])
        y = torch.where(positions >= y.shape[1] - pad[:, None], ignore_index, y)
        self.train_data = torch.utils.data.TensorDataset(x, y)


class HFCausalLMWithLabels(pm.HFCausalLM):
    """The other usual Hugging Face step: the model computes its own (shifted) loss from ``labels``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self._log_loss(self.model(input_ids=x, labels=y).loss)


class _Rows(torch.utils.data.Dataset):
    """Rows of named tensors: a tokenizer's and collator's dict batches."""

    def __init__(self, **columns: torch.Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: column[index] for name, column in self.columns.items()}


class RightPaddedDicts(RandomTokenDataModule):
    """Hugging Face's dict batches padded on the right: ``input_ids`` with the pad token (0) after each sample's
    last 0-12 tokens, ``attention_mask`` 0 there and ``labels`` the ids with -100 there (what a tokenizer with
    padding_side='right' and DataCollatorForLanguageModeling give)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        x, _ = self.train_data.tensors
        pad = torch.randint(0, 13, (len(x),), generator=torch.Generator().manual_seed(7))
        mask = (torch.arange(x.shape[1]) < x.shape[1] - pad[:, None]).long()
        ids = torch.where(mask.bool(), x, 0)
        self.train_data = _Rows(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), x, -100))


class HFCausalLMOnDicts(pm.HFCausalLM):
    """The usual Hugging Face step on a collator's dict batch: ``self.model(**batch).loss``."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._log_loss(self.model(**batch).loss)


def _tokens(batch: int, seq_len: int = 32) -> Any:
    return functools.partial(RandomTokenDataModule, vocab_size=pm.VOCAB, seq_len=seq_len, batch_size=batch)


def _padded(batch: int, ignore_index: int) -> Any:
    return functools.partial(PaddedTokens, ignore_index, vocab_size=pm.VOCAB, seq_len=32, batch_size=batch)


def _right_padded(batch: int) -> Any:
    return functools.partial(RightPaddedDicts, vocab_size=pm.VOCAB, seq_len=32, batch_size=batch)


NANOGPT = functools.partial(NanoGPTModule, n_layer=2)
LLAMA = functools.partial(pm.HFCausalLM, "llama", dropout=0.0)
LLAMA_LABELS = functools.partial(HFCausalLMWithLabels, "llama", dropout=0.0)
BF16 = {"precision": "bf16-mixed"}
# name: (model, data per global batch, strategy, devices, trainer kwargs)
CASES: dict[str, tuple[Any, Any, dict[str, Any], int, dict[str, Any]]] = {
    "nanoGPT cp 2 ring": (NANOGPT, _tokens, {"context_parallel_size": 2}, 2, {}),
    "nanoGPT cp 2 alltoall": (NANOGPT, _tokens, {"context_parallel_size": 2, "context_parallel_mode": "alltoall"}, 2,
                              {}),
    "Llama cp 2 ring": (LLAMA, _tokens, {"context_parallel_size": 2}, 2, {}),
    "Llama cp 2 alltoall": (LLAMA, _tokens, {"context_parallel_size": 2, "context_parallel_mode": "alltoall"}, 2, {}),
    "Llama, labels, padded, cp 2": (LLAMA_LABELS, functools.partial(_padded, ignore_index=-100),
                                    {"context_parallel_size": 2}, 2, {}),
    "Llama, dict batch, right-padded attention_mask, cp 2": (functools.partial(HFCausalLMOnDicts, "llama",
                                                                              dropout=0.0),
                                                            _right_padded, {"context_parallel_size": 2}, 2, {}),
    "nanoGPT, padded, cp 2": (NANOGPT, functools.partial(_padded, ignore_index=-1), {"context_parallel_size": 2}, 2,
                              {}),
    "nanoGPT cp 4 ring": (NANOGPT, _tokens, {"context_parallel_size": 4}, 4, {}),
    "nanoGPT dp 2 x cp 2 ZeRO-0": (NANOGPT, _tokens, {"context_parallel_size": 2}, 4, {}),
    "nanoGPT dp 2 x cp 2 ZeRO-2": (NANOGPT, _tokens, {"context_parallel_size": 2, "zero_stage": 2}, 4, {}),
    "nanoGPT dp 2 x cp 2 ZeRO-3": (NANOGPT, _tokens, {"context_parallel_size": 2, "zero_stage": 3}, 4, {}),
    "Llama dp 2 x cp 2 ZeRO-1 alltoall": (LLAMA, _tokens, {"context_parallel_size": 2, "zero_stage": 1,
                                                          "context_parallel_mode": "alltoall"}, 4, {}),
    "nanoGPT tp 2 x cp 2, sequence parallel": (NANOGPT, _tokens, {"context_parallel_size": 2, "tensor_parallel_size": 2,
                                                                "sequence_parallel": True}, 4, {}),
    "Llama tp 2 x cp 2": (LLAMA, _tokens, {"context_parallel_size": 2, "tensor_parallel_size": 2}, 4, {}),
    "nanoGPT pp 2 x cp 2 1F1B": (NANOGPT, _tokens, {"context_parallel_size": 2, "pipeline_parallel_size": 2}, 4, {}),
    "Llama cp 2, activation checkpointing": (LLAMA, _tokens, {"context_parallel_size": 2,
                                                             "activation_checkpointing": True}, 2, {}),
    "Llama dp 2 x cp 2 ZeRO-3 bf16-mixed": (LLAMA, _tokens, {"context_parallel_size": 2, "zero_stage": 3}, 4, BF16),
}  # fmt: skip


def _dp(strategy: dict[str, Any], devices: int) -> int:
    others = [strategy.get(k, 1) for k in ("context_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")]
    return devices // (others[0] * others[1] * others[2])


class CPGroup(L.Callback):
    """Each rank's context-parallel group and the number of ring/all-to-all attention calls it made."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        self.results["cp_group"] = dist.get_process_group_ranks(strategy.device_mesh[CP_AXIS].get_group())
        self.results["attention_calls"] = strategy.context_parallel.attention_calls  # type: ignore[attr-defined]


# The slow tier: the 4-rank layouts the quick tier already trains once in another form (dp x cp under ZeRO 1 and 3,
# tp x cp on both models' attention through nanoGPT).
SLOW_CASES = {
    "nanoGPT dp 2 x cp 2 ZeRO-0",
    "nanoGPT dp 2 x cp 2 ZeRO-2",
    "nanoGPT dp 2 x cp 2 ZeRO-3",
    "Llama tp 2 x cp 2",
}
_outcomes: dict[tuple[int, bool], dict[str, Any]] = {}


def _trained(devices: int, slow: bool) -> dict[str, Any]:
    """Every case of one world size and tier in one job."""
    if (devices, slow) not in _outcomes:
        runs = {
            name: Run(model, data(GLOBAL_BATCH // _dp(strategy, world)), strategy, STEPS, trainer, lambda: [CPGroup()])
            for name, (model, data, strategy, world, trainer) in CASES.items()
            if world == devices and (name in SLOW_CASES) == slow
        }
        _outcomes[devices, slow] = fit_each(runs, devices, timeout=900)
    return _outcomes[devices, slow]


@pytest.mark.parametrize("case", [tiers.case(name, slow=name in SLOW_CASES) for name in CASES])
def test_context_parallel_trains_like_one_process(case):
    model, data, strategy, devices, trainer = CASES[case]
    (reference,) = references({case: Run(model, data(GLOBAL_BATCH), None, STEPS, trainer)}).values()
    trained, extras = result(_trained(devices, case in SLOW_CASES)[case])
    if trainer.get("precision") == "bf16-mixed":
        tolerances = {"loss_rtol": BF16_RTOL, "weight_rtol": BF16_RTOL, "weight_atol": BF16_RTOL}
        assert_same_training(result(reference), trained, **tolerances)
    else:
        assert_same_training(result(reference), trained, weight_atol=WEIGHT_ATOL)
    cp = strategy["context_parallel_size"]
    for extra in extras:
        assert len(extra["cp_group"]) == cp, extra
        # Consecutive ranks under tp (cp next to it), else neighbours: the group is what the mesh says.
        assert extra["attention_calls"] > 0, extra


def test_a_context_parallel_checkpoint_resumes_on_one_process(tmp_path):
    """Saved at step 3 of 6 under cp 2 (ring), resumed on one process: the resumed steps' losses as the
    uninterrupted run's, and the states loaded equal to those saved."""
    from tests.test_checkpoint import CROSS_LAYOUT_RTOL, SaveAt, _assert_same_states, _losses_match

    saved, _ = fit(
        LLAMA, _tokens(GLOBAL_BATCH), {"context_parallel_size": 2}, 2, STEPS,
        callbacks_factory=lambda: [SaveAt(tmp_path, (3,))],
    )  # fmt: skip
    resaved = tmp_path / "one"
    resaved.mkdir()
    resumed, _ = fit(
        LLAMA, _tokens(GLOBAL_BATCH), {}, 1, STEPS,
        callbacks_factory=lambda: [SaveAt(resaved, resave=True)],
        fit_kwargs={"ckpt_path": str(tmp_path / "step3.ckpt")},
    )  # fmt: skip
    _losses_match(saved.losses, resumed.losses, 3, CROSS_LAYOUT_RTOL)
    _assert_same_states(tmp_path / "step3.ckpt", resaved / "resaved.ckpt")


def test_a_one_process_checkpoint_resumes_under_context_parallelism(tmp_path):
    """The other direction: saved at step 3 of 6 on one process, resumed under cp 2 (ring)."""
    from tests.test_checkpoint import CROSS_LAYOUT_RTOL, SaveAt, _assert_same_states, _losses_match

    saved, _ = fit(LLAMA, _tokens(GLOBAL_BATCH), {}, 1, STEPS, callbacks_factory=lambda: [SaveAt(tmp_path, (3,))])
    resaved = tmp_path / "cp"
    resaved.mkdir()
    resumed, _ = fit(
        LLAMA, _tokens(GLOBAL_BATCH), {"context_parallel_size": 2}, 2, STEPS,
        callbacks_factory=lambda: [SaveAt(resaved, resave=True)],
        fit_kwargs={"ckpt_path": str(tmp_path / "step3.ckpt")},
    )  # fmt: skip
    _losses_match(saved.losses, resumed.losses, 3, CROSS_LAYOUT_RTOL)
    _assert_same_states(tmp_path / "step3.ckpt", resaved / "resaved.ckpt")


class HandWrittenAttention(L.LightningModule):
    """Attention as softmax(q k^T) v written out: nothing context parallelism can see to split."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(pm.VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, pm.VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        q, k, v = self.qkv(self.embed(x)).chunk(3, dim=-1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        att = (q @ k.transpose(-2, -1) / 4).masked_fill(mask, float("-inf")).softmax(-1)
        return torch.nn.functional.cross_entropy(self.head(att @ v).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


class LeftPaddedDicts(RightPaddedDicts):
    """The padding before the tokens (padding_side='left'), labels -100 there."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        columns = self.train_data.columns
        self.train_data = _Rows(**{name: column.flip(1) for name, column in columns.items()})


class PaddingTrained(RightPaddedDicts):
    """Right padding whose labels are the pad token, not -100: the padding's outputs would be trained."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        columns = self.train_data.columns
        self.train_data = _Rows(**{**columns, "labels": columns["input_ids"]})


class WindowedMistral(HFCausalLMOnDicts):
    """Hugging Face Mistral (sliding-window attention) with a window of 16 tokens, shorter than the batch's 32."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from transformers import AutoModelForCausalLM

        config = pm.hf_config("mistral", 0.0)
        config.sliding_window = 16
        self.model = AutoModelForCausalLM.from_config(config)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def _dicts(kind: type) -> Any:
    return functools.partial(kind, vocab_size=pm.VOCAB, seq_len=32, batch_size=4)


LLAMA_DICTS = functools.partial(HFCausalLMOnDicts, "llama", dropout=0.0)
REFUSED = {
    "left padding": (LLAMA_DICTS, _dicts(LeftPaddedDicts), {"context_parallel_size": 2},
                     r"`attention_mask` has padding before tokens.*padding_side='right'"),
    "padding trained": (LLAMA_DICTS, _dicts(PaddingTrained), {"context_parallel_size": 2},
                        r"give the batch `labels` with the ignore index \(-100\) wherever `attention_mask` is 0"),
    "sliding window": (WindowedMistral, _dicts(RightPaddedDicts), {"context_parallel_size": 2},
                       r"MistralConfig attends through a sliding window of 16 tokens, shorter than the batch's 32"),
    "hand-written attention": (HandWrittenAttention, _tokens(4), {"context_parallel_size": 2},
                               r"called no `torch.nn.functional.scaled_dot_product_attention`"),
    "sequence not divisible": (NANOGPT, functools.partial(_tokens(4), seq_len=30), {"context_parallel_size": 2},
                               r"sequences have 30 tokens. Pad or cut them to a multiple of 4"),
    "alltoall heads": (functools.partial(NanoGPTModule, n_layer=1, n_head=1), _tokens(4),
                       {"context_parallel_size": 2, "context_parallel_mode": "alltoall"},
                       r"this attention has 1 heads per rank.*context_parallel_mode='ring'"),
}  # fmt: skip


def _refusals() -> dict[str, str]:
    runs = {name: Run(model, data, strategy, 1) for name, (model, data, strategy, _) in REFUSED.items()}
    return {name: outcome if isinstance(outcome, str) else "trained" for name, outcome in fit_each(runs, 2).items()}


_refused: dict[str, str] = {}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_context_parallelism_cannot_make_exact_is_refused_in_the_first_step(case):
    if not _refused:
        _refused.update(_refusals())
    import re

    assert re.search(REFUSED[case][3], _refused[case], re.DOTALL), _refused[case][-2000:]


def test_attention_other_than_sdpa_is_refused_before_training():
    """Hugging Face models built with eager (Gemma 2's default), FlexAttention or flash-attention kernels: each rank
    would attend within its own shard. Refused when the strategy sets up, naming the implementation."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(NotImplementedError, match=r"Gemma2Config of `model` uses attn_implementation='eager'"):
        check_module(pm.HFCausalLM("gemma2", dropout=0.0))
    flex = AutoModelForCausalLM.from_config(pm.hf_config("llama", 0.0), attn_implementation="flex_attention")
    with pytest.raises(NotImplementedError, match=r"attn_implementation='flex_attention'.*attn_implementation='sdpa'"):
        check_module(flex)
    check_module(WindowedMistral())  # SDPA with a window: split exactly for sequences the window covers


def test_rotary_tables_sliced_by_the_local_length_are_refused_before_training():
    """litgpt's ``cos``/``sin`` and torchtitan's ``freqs_cis`` are sliced by the length the model sees."""
    with pytest.raises(NotImplementedError, match=r"rotary table `model.cos`"):
        check_module(pm.LitGPTModule())
    with pytest.raises(NotImplementedError, match=r"rotary table `model.freqs_cis`"):
        check_module(pm.TorchTitanLlama())
    check_module(LLAMA())  # Hugging Face rotary embeddings take position_ids
    check_module(NANOGPT())


OPTION_ERRORS = {
    "mode without cp": ({"context_parallel_mode": "alltoall"}, ValueError,
                        r"`context_parallel_mode='alltoall'`.*needs context_parallel_size > 1"),
    "unknown mode": ({"context_parallel_size": 2, "context_parallel_mode": "ulysses"}, ValueError,
                     r"`context_parallel_mode` must be one of 'ring', 'alltoall'"),
    "deepspeed": ({"context_parallel_size": 2, "zero_stage": 2, "zero_backend": "deepspeed"}, NotImplementedError,
                  r"context_parallel_size=2 does not compose with zero_backend='deepspeed'"),
    "hsdp": ({"context_parallel_size": 2, "zero_stage": 2, "data_parallel_shard_size": 1}, NotImplementedError,
             r"does not compose with data_parallel_shard_size=1"),
    "world": ({"context_parallel_size": 3}, ValueError, r"context_parallel_size=3 does not divide the world size 4"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(OPTION_ERRORS))
def test_context_parallel_options_are_checked_before_any_process_starts(case):
    kwargs, error, message = OPTION_ERRORS[case]
    with pytest.raises(error, match=message):
        L.Trainer(accelerator="cpu", devices=4, strategy=HybridStrategy(**kwargs), logger=False)


class ContextTraffic(L.Callback):
    """Bytes this rank sends per training step through the ring's point-to-point exchanges (forward and backward)
    and the all-to-alls' forward calls: each call observed, then passed on unchanged."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {"ring": [], "alltoall_forward": []}
        self._undo: list[tuple[Any, str, Any]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_mgpu._compat.c10d import functional_collectives

        ring, alltoall = [0], [0]
        self.results["ring"].append(ring)
        self.results["alltoall_forward"].append(alltoall)
        funcol = functional_collectives()
        batch, exchange = dist.batch_isend_irecv, funcol.all_to_all_single_autograd

        def counted_batch(ops: list) -> Any:
            ring[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return batch(ops)

        def counted_exchange(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            cp = dist.get_world_size(args[2] if len(args) > 2 else kwargs["group"])
            alltoall[0] += tensor.numel() * tensor.element_size() * (cp - 1) // cp
            return exchange(tensor, *args, **kwargs)

        self._undo = [(dist, "batch_isend_irecv", batch), (funcol, "all_to_all_single_autograd", exchange)]
        dist.batch_isend_irecv, funcol.all_to_all_single_autograd = counted_batch, counted_exchange

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)


@pytest.mark.parametrize(
    ("mode", "cp"),
    # The slow tier: the ring at cp 2 (the quick tier counts it at cp 4, where each rank passes on more than once).
    [pytest.param("ring", 2, marks=pytest.mark.slow), ("alltoall", 2), ("ring", 4)],
)
def test_context_parallel_traffic_is_the_analytic_volume(mode, cp):
    """nanoGPT (2 blocks, 32 tokens, width 32) at cp 2 and 4: the ring sends each block's K/V (cp-1) hops forward,
    (cp-1) hops again backward with their fp32 gradients cp hops; the all-to-all exchanges (cp-1)/cp of q, k, v and
    the output forward and their gradients backward: ``planner.cost.context_parallel_bytes``, per block and step.
    The ring's sends and the all-to-all's forward calls are counted where they are issued; the all-to-all's
    backward (autograd's, from C++) by the profiler's record of every collective the step ran."""
    from lightning_mgpu.options import ParallelOptions
    from lightning_mgpu.planner.cost import context_parallel_bytes
    from lightning_mgpu.planner.job import Layout, Microbatching, Training
    from lightning_mgpu.planner.model_spec import ModelSpec

    strategy = {"context_parallel_size": cp, "context_parallel_mode": mode}
    probes = lambda: [ContextTraffic(), CollectiveCounter()]
    outcome = fit_each({"counted": Run(NANOGPT, _tokens(GLOBAL_BATCH), strategy, 3, {}, probes)}, cp)
    _, extras = result(outcome["counted"])
    spec = ModelSpec(layers=2, hidden=32, heads=4, vocab=pm.VOCAB, seq_len=32)
    options = ParallelOptions(context_parallel_mode=mode)
    layout = Layout.of(cp=cp, options=options, microbatching=Microbatching(size=GLOBAL_BATCH))
    per_block = context_parallel_bytes(spec, Training(GLOBAL_BATCH, precision="32-true"), layout)
    # By hand, per block and rank: the ring sends K and V ((B, T/cp, C) fp32 each) cp-1 hops forward; backward
    # sends them cp-1 hops again and their gradients cp hops (home).
    kv = 2 * GLOBAL_BATCH * (32 // cp) * 32 * 4
    if mode == "ring":
        assert per_block == {"forward": (cp - 1) * kv, "backward": (2 * cp - 1) * kv}, per_block
    for extra in extras:
        if mode == "ring":
            expected = spec.layers * (per_block["forward"] + per_block["backward"])
            assert [step[0] for step in extra["ring"]] == [expected] * 3, (extra["ring"], expected)
        else:
            expected = spec.layers * per_block["forward"]
            assert [step[0] for step in extra["alltoall_forward"]] == [expected] * 3, (extra, expected)
            both = spec.layers * (per_block["forward"] + per_block["backward"])
            counted = [step.get("A2A", 0.0) for step in extra["bytes_by_kind_per_batch"]]
            assert counted == [pytest.approx(both)] * 3, (counted, both)
