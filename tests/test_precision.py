"""HybridPrecision across layouts: bf16/fp16 mixed, true half, fp8, reduce/param dtypes, and job-wide loss scaling.

Tolerances are measured on the tiny Llama over 10 AdamW steps (lr 1e-3):
- every mixed precision against the single-process run *of the same precision*: per-step losses within ~2e-5
  relative for dp2 ZeRO-0/1/3, dp2 x tp2 ZeRO-3 and pp2 x tp2 (bf16 and fp16), i.e. the layout does not change the
  numerics; the issue's acceptance bound is 2e-2.
- against fp32: bf16-mixed 2.6e-5, 16-mixed 8.4e-6, fp8-mixed (emulated) 2.5e-4, bf16-true 5.9e-3 relative.
- final weights move by up to ~lr per step under AdamW wherever gradients are near zero, so weights are compared
  with an absolute tolerance of a few lr (measured max |diff| 1e-3 to 4e-3).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor

from lightning_mgpu import HybridPrecision, HybridStrategy
from lightning_mgpu.precision import JobGradScaler
from tests.helpers.equivalence import fit
from tests.helpers.modules import CNNModule, LlamaModule, RandomImageDataModule, RandomTokenDataModule

STEPS = 10
LAYOUT_RTOL = 1e-4  # same precision, different layout (measured <= 2.1e-5)
BF16_RTOL = 2e-2  # the bound for bf16-mixed against the single-process bf16-mixed run
FP32_RTOL = 1e-3  # a mixed precision against fp32 over 10 steps (measured <= 2.5e-4, fp8 included)
WEIGHT_ATOL = 1e-2  # 10 AdamW steps of lr 1e-3: near-zero gradients turn rounding into ~lr steps
INJECT_STEP, INJECT_RANK = 3, 1


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StepProbe(L.Callback):
    """Per step and rank: did this rank's weights change, and the loss scale after the step. Optionally puts an
    inf into one element of one gradient on one rank after backward at one step (before unscaling)."""

    def __init__(self, inject_step: int | None = None, inject_rank: int = 0) -> None:
        self.inject_step, self.inject_rank = inject_step, inject_rank
        self.results: dict = {"changed": [], "scale": []}

    def _injecting(self, trainer) -> bool:
        return trainer.global_step == self.inject_step and trainer.global_rank == self.inject_rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = [_local(p).detach().clone() for p in pl_module.parameters()]
        self._hook = None
        if self._injecting(trainer) and getattr(trainer.strategy, "_pipeline", None) is not None:
            # The pipeline schedule runs backward inside the step (no on_after_backward): poison a gradient as
            # autograd produces it, on this rank's stage.
            param = next(p for p in pl_module.parameters() if p.requires_grad and _local(p).numel())
            self._hook = param.register_hook(lambda grad: grad * float("inf"))

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._injecting(trainer):
            grad = next(_local(p.grad) for p in pl_module.parameters() if p.grad is not None and _local(p.grad).numel())
            grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self._hook is not None:
            self._hook.remove()
        after = [_local(p) for p in pl_module.parameters()]
        self.results["changed"].append(any(not torch.equal(b, a) for b, a in zip(self._before, after)))
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        self.results["scale"].append(scaler.get_scale() if scaler is not None else None)
        self.results["precision"] = plugin.precision
        self.results["plugin"] = type(plugin).__name__
        self.results["float8_layers"] = sum(type(m).__name__ == "Float8Linear" for m in pl_module.modules())
        self.results["param_dtypes"] = sorted({str(p.dtype) for p in pl_module.parameters()})


def _llama_data(batch: int):
    return lambda: RandomTokenDataModule(batch_size=batch)


_references: dict = {}


def reference(precision: str, inject: bool = False):
    """Single-process plain Lightning (DDP on one process) at ``precision``; fp16 through Lightning's own
    MixedPrecision plugin (``precision="16-mixed"`` would become bf16 on CPU)."""
    key = (precision, inject)
    if key not in _references:
        trainer_kwargs: dict = {"precision": precision}
        if precision == "16-mixed":
            trainer_kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
        probe = (lambda: [StepProbe(INJECT_STEP, 0)]) if inject else (lambda: [StepProbe()])
        _references[key] = fit(
            LlamaModule, _llama_data(8), None, 1, STEPS, trainer_kwargs=trainer_kwargs, callbacks_factory=probe
        )
    return _references[key]


def _trainer_precision(precision: str) -> dict:
    """``Trainer(precision=...)``; fp16 with loss scaling on CPU through the explicit plugin (Lightning runs
    ``Trainer(accelerator="cpu", precision="16-mixed")`` as bf16-mixed, and HybridStrategy follows it)."""
    return {"plugins": [HybridPrecision(precision)]} if precision == "16-mixed" else {"precision": precision}


def _assert_close_run(result, expected, loss_rtol: float, weight_atol: float = WEIGHT_ATOL) -> None:
    assert all(torch.isfinite(torch.tensor(result.losses))), result.losses
    torch.testing.assert_close(
        torch.tensor(result.losses, dtype=torch.float64),
        torch.tensor(expected.losses, dtype=torch.float64),
        rtol=loss_rtol,
        atol=0,
    )
    assert set(result.state_dict) == set(expected.state_dict)
    for key, value in expected.state_dict.items():
        torch.testing.assert_close(
            result.state_dict[key].float(), value.float(), rtol=0, atol=weight_atol, msg=lambda m: f"{key}: {m}"
        )


# ------------------------------------------------------------------------------------------------ the plugin
def test_autocast_uses_the_precision_dtype_on_the_device_type():
    for name, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16), ("32-true", torch.float32)):
        with HybridPrecision(name, device_type="cpu").forward_context():
            assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == dtype, name


def test_true_half_precisions_cast_the_module_and_inputs():
    for name, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16)):
        plugin = HybridPrecision(name)
        module = plugin.convert_module(torch.nn.Linear(4, 4))
        assert module.weight.dtype == dtype
        assert plugin.convert_input(torch.randn(2, 4)).dtype == dtype
        assert plugin.convert_input(torch.arange(3)).dtype == torch.int64
        with plugin.forward_context():
            assert torch.zeros(1).dtype == dtype  # tensors made inside forward
        assert plugin.scaler is None and plugin.mp_policy() is None


def test_options_are_validated_and_become_an_fsdp_policy():
    with pytest.raises(ValueError, match="does not support precision='64-true'"):
        HybridPrecision("64-true")
    with pytest.raises(ValueError, match="`param_dtype` applies to the mixed precisions"):
        HybridPrecision("bf16-true", param_dtype="bf16")
    with pytest.raises(ValueError, match="`reduce_dtype` must be"):
        HybridPrecision("bf16-mixed", reduce_dtype="int8")
    with pytest.raises(ValueError, match="fp8_emulate=True` applies to precision='fp8-mixed'"):
        HybridPrecision("bf16-mixed", fp8_emulate=True)
    assert HybridPrecision("bf16-mixed").mp_policy() is None  # FSDP2 defaults: fp32 weights under autocast
    policy = HybridPrecision("bf16-mixed", param_dtype="bf16", reduce_dtype=torch.float32).mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert HybridPrecision("32-true", reduce_dtype="bf16").mp_policy().param_dtype is None


def test_lightning_plugins_and_flags_are_translated():
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=7)
    plugin = HybridPrecision.from_lightning(MixedPrecision("16-mixed", "cpu", scaler=scaler), "cpu")
    assert plugin.precision == "16-mixed" and isinstance(plugin.scaler, JobGradScaler)
    assert plugin.scaler.get_scale() == 128.0 and plugin.scaler.get_growth_interval() == 7
    # Lightning's choice runs: "16-mixed" on CPU is bf16-mixed (Lightning warns); fp16 there is the explicit plugin.
    runs_as = [("bf16-mixed",) * 2, ("bf16-true",) * 2, ("16-true",) * 2, ("32-true",) * 2, ("16-mixed", "bf16-mixed")]
    for flag, runs in runs_as:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(), precision=flag, logger=False)
        assert isinstance(trainer.precision_plugin, HybridPrecision), flag
        assert trainer.precision_plugin.precision == runs
        assert trainer.precision_plugin.scaler is None
    explicit = HybridPrecision("16-mixed", reduce_dtype="bf16")
    assert explicit.scaler is not None
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(), plugins=[explicit], logger=False)
    assert trainer.precision_plugin is explicit


def test_scaler_state_round_trips_through_the_plugin():
    state = HybridPrecision("16-mixed", init_scale=256.0).state_dict()
    restored = HybridPrecision("16-mixed")
    restored.load_state_dict(state)
    assert restored.scaler.get_scale() == 256.0
    restored.load_state_dict({})  # a checkpoint without scaler state leaves it alone
    assert HybridPrecision("bf16-mixed").state_dict() == {}


def test_fp8_refusals_are_clear(monkeypatch):
    pytest.importorskip("torchao")
    # The device is known once the strategy has it, when the Trainer is built: before any process starts.
    with pytest.raises(ValueError, match=r"no float8 matmul kernels on CPU. Pass `fp8_emulate=True`"):
        L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=HybridStrategy(),
            plugins=[HybridPrecision("fp8-mixed")],
            logger=False,
        )
    plugin = HybridPrecision.from_lightning(HybridPrecision("fp8-mixed", fp8_emulate=True), "cpu")
    assert plugin.autocast_dtype == torch.bfloat16
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"lightning-mgpu\[fp8\]"):
        HybridPrecision("fp8-mixed", fp8_emulate=True)


# ----------------------------------------------------------------------------------------- fp16 loss scaling
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"zero_stage": 0}, id="dp2-zero0"),
        # The slow tier: ZeRO-3's data-parallel peers alone (the quick tier has them beside the tp peer below).
        pytest.param({"zero_stage": 3}, id="dp2-zero3", marks=pytest.mark.slow),
        pytest.param({"zero_stage": 3, "tensor_parallel_size": 2}, id="dp2xtp2-zero3"),  # rank 1: rank 0's tp peer
        pytest.param({"pipeline_parallel_size": 2}, id="pp2"),  # rank 1 holds the second stage
    ],
)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(layout):
    world = 2 * layout.get("tensor_parallel_size", 1)
    dp = 1 if "pipeline_parallel_size" in layout else 2
    # fp16 with loss scaling on CPU is the explicit plugin (Lightning runs Trainer(precision="16-mixed") as bf16).
    trainer_kwargs = {"plugins": [HybridPrecision("16-mixed")]}
    result, extras = fit(
        LlamaModule,
        _llama_data(8 // dp),
        layout,
        world,
        STEPS,
        trainer_kwargs=trainer_kwargs,
        callbacks_factory=lambda: [StepProbe(INJECT_STEP, INJECT_RANK)],
    )
    expected, expected_extras = reference("16-mixed", inject=True)
    for rank, extra in enumerate(extras):
        assert extra["plugin"] == "HybridPrecision" and extra["precision"] == "16-mixed", (rank, extra)
        # Every rank skipped exactly the injected step, and only it; then training went on.
        assert extra["changed"] == [step != INJECT_STEP for step in range(STEPS)], (rank, extra["changed"])
        # One scaler state: the same scales on every rank, halved at the skipped step, as in the reference.
        assert extra["scale"] == expected_extras[0]["scale"], (rank, extra["scale"])
        assert extra["scale"][INJECT_STEP] == extra["scale"][INJECT_STEP - 1] / 2
    # The same training as one fp16 process that skipped the same step.
    _assert_close_run(result, expected, LAYOUT_RTOL)


class _SaveAt(L.Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_the_loss_scale_is_saved_and_restored_with_checkpoints(tmp_path):
    """An inf on rank 1 at step 1 halves the scale; a checkpoint at step 4 carries it, and a resumed run continues
    the uninterrupted run exactly (scale, skipped-step bookkeeping and losses)."""
    from lightning_mgpu.checkpoint import format as fmt

    path = tmp_path / "step4.ckpt"
    kwargs = {"trainer_kwargs": {"plugins": [HybridPrecision("16-mixed")]}}
    whole, whole_extras = fit(
        LlamaModule,
        _llama_data(4),
        {"zero_stage": 3},
        2,
        8,
        **kwargs,
        callbacks_factory=lambda: [StepProbe(1, INJECT_RANK), _SaveAt(path, 4)],
    )
    meta = fmt.load_file(path, False)
    assert meta["HybridPrecision"]["scale"] == 2.0**15  # halved once, at the injected step
    resumed, resumed_extras = fit(
        LlamaModule,
        _llama_data(4),
        {"zero_stage": 3},
        2,
        8,
        **kwargs,
        callbacks_factory=lambda: [StepProbe()],
        fit_kwargs={"ckpt_path": str(path)},
    )
    assert resumed.losses == whole.losses[4:]
    for whole_rank, resumed_rank in zip(whole_extras, resumed_extras):
        assert resumed_rank["scale"] == whole_rank["scale"][4:] == [2.0**15] * 4


# ------------------------------------------------------------------------------------ precisions by layout
@pytest.mark.parametrize(
    "precision,layout",
    [
        ("bf16-mixed", {"zero_stage": 3, "tensor_parallel_size": 2}),
        ("bf16-mixed", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
        ("16-mixed", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
    ],
    ids=["bf16-dp2xtp2-zero3", "bf16-pp2xtp2", "fp16-pp2xtp2"],
)
def test_mixed_precision_tracks_one_process_in_every_layout(precision, layout):
    dp = 2 if "pipeline_parallel_size" not in layout else 1
    result, extras = fit(
        LlamaModule,
        _llama_data(8 // dp),
        layout,
        4,
        STEPS,
        trainer_kwargs=_trainer_precision(precision),
        callbacks_factory=lambda: [StepProbe()],
    )
    assert {e["precision"] for e in extras} == {precision}
    assert all(e["param_dtypes"] == ["torch.float32"] for e in extras)  # fp32 master weights
    same_precision, _ = reference(precision)
    fp32, _ = reference("32-true")
    assert result.losses != fp32.losses  # autocast really ran
    _assert_close_run(result, same_precision, LAYOUT_RTOL if precision == "16-mixed" else BF16_RTOL)
    _assert_close_run(result, fp32, FP32_RTOL)
    if precision == "16-mixed":
        scales = {tuple(e["scale"]) for e in extras}
        assert len(scales) == 1, scales  # pipeline stages and tensor peers share one scale


class _ReductionDtypes(L.Callback):
    """The dtypes of the gradient all-reduces (more than one element) issued in backward, and of the weights a
    Linear layer computes with."""

    def __init__(self) -> None:
        self.results: dict = {"dtypes": set()}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        import torch.distributed as dist

        if getattr(self, "_patched", False):
            return
        self._patched = True
        for name in ("all_reduce",):
            original = getattr(dist, name)

            def recording(*args, _original=original, **kwargs):
                self.results["dtypes"].update(str(a.dtype) for a in args if torch.is_tensor(a) and a.numel() > 1)
                return _original(*args, **kwargs)

            setattr(dist, name, recording)

    def on_train_start(self, trainer, pl_module) -> None:
        # torchao's FSDP2 float8 weights: sharded as WeightWithDynamicFloat8CastTensor, all-gathered in float8.
        self.results["float8_all_gather_weights"] = sum(
            type(getattr(m.weight, "_local_tensor", None)).__name__ == "WeightWithDynamicFloat8CastTensor"
            for m in pl_module.modules()
            if type(m).__name__ == "Float8Linear"
        )
        dtypes = self.results["forward_weight_dtypes"] = set()
        linear = next(m for m in pl_module.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_pre_hook(lambda module, args: dtypes.add(str(module.weight.dtype)))


@pytest.mark.parametrize(
    "plugin,layout,compare_to",
    [
        (dict(precision="32-true", reduce_dtype="bf16"), {"zero_stage": 1}, "32-true"),
        (dict(precision="bf16-mixed", param_dtype="bf16", reduce_dtype="fp32"), {"zero_stage": 3}, "bf16-mixed"),
        (dict(precision="fp8-mixed", fp8_emulate=True), {"zero_stage": 2}, "32-true"),
        (dict(precision="fp8-mixed", fp8_emulate=True), {"zero_stage": 3}, "32-true"),
    ],
    ids=["reduce-bf16-zero1", "param-bf16-zero3", "fp8-emulated-zero2", "fp8-emulated-zero3-float8-all-gather"],
)
def test_fsdp_policies_and_fp8_train_close_to_the_reference(plugin, layout, compare_to):
    if plugin["precision"] == "fp8-mixed":
        pytest.importorskip("torchao")
    result, extras = fit(
        LlamaModule,
        _llama_data(4),
        layout,
        2,
        STEPS,
        trainer_kwargs={"plugins": [HybridPrecision(**plugin)]},
        callbacks_factory=lambda: [StepProbe(), _ReductionDtypes()],
    )
    expected, _ = reference(compare_to)
    _assert_close_run(result, expected, FP32_RTOL if compare_to == "32-true" else BF16_RTOL)
    if plugin.get("reduce_dtype") == "bf16":
        assert extras[0]["dtypes"] == {"torch.bfloat16"}, extras[0]["dtypes"]
    if plugin.get("param_dtype"):
        assert extras[0]["forward_weight_dtypes"] == {"torch.bfloat16"}  # FSDP2 gathered bf16 copies
    if plugin["precision"] == "fp8-mixed":
        assert extras[0]["float8_layers"] == 15  # every Linear of the 2-layer Llama (q, k, v, o, 3 MLP; head)
        assert result.losses != expected.losses
        # ZeRO-3 all-gathers the float8 weights in float8 (their scales precomputed after each step); ZeRO-2 keeps
        # whole weights, nothing to gather.
        assert extras[0]["float8_all_gather_weights"] == (15 if layout["zero_stage"] == 3 else 0), extras[0]


def test_true_half_precision_trains_in_half():
    fp32, _ = fit(LlamaModule, _llama_data(8), None, 1, STEPS)
    bf16, extras = fit(
        LlamaModule,
        _llama_data(4),
        {"zero_stage": 2},
        2,
        STEPS,
        trainer_kwargs={"precision": "bf16-true"},
        callbacks_factory=lambda: [StepProbe()],
    )
    assert extras[0]["param_dtypes"] == ["torch.bfloat16"]
    assert {v.dtype for v in bf16.state_dict.values()} == {torch.bfloat16}
    _assert_close_run(bf16, fp32, BF16_RTOL, weight_atol=5e-2)
    # fp16 weights cannot hold Adam's default eps (1e-8 rounds to 0): the SGD CNN trains in 16-true.
    cnn32, _ = fit(CNNModule, lambda: RandomImageDataModule(batch_size=8), None, 1, STEPS)
    cnn16, _ = fit(
        CNNModule,
        lambda: RandomImageDataModule(batch_size=4),
        {"zero_stage": 0},
        2,
        STEPS,
        trainer_kwargs={"precision": "16-true"},
    )
    assert {v.dtype for v in cnn16.state_dict.values()} == {torch.float16}
    _assert_close_run(cnn16, cnn32, BF16_RTOL, weight_atol=5e-2)
