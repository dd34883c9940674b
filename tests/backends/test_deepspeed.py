"""zero_backend="deepspeed": ZeRO 1-3 through DeepSpeed's engine train like one process, memory follows the ZeRO
formulas, checkpoints cross to and from the torch backend, bad configs fail before training.

Several fits share one spawn (each spawn pays DeepSpeed's import and engine set-up once). The first use of
DeepSpeed's engine on a machine compiles its CPU communication op (``deepspeed_shm_comm``, 30-130 s on 2 cores,
cached in ``~/.cache/torch_extensions``); ``_run`` does it once in the test process before its first spawn, so the
config checks (the quick tier, no engine) never pay it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import re
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from typing_extensions import override

from lightning_mgpu import HybridPrecision, HybridStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import RunResult, _fit_worker, assert_same_training
from tests.helpers.modules import GPT2Module, LlamaModule, RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule
from tests.helpers.probes import MemoryProbe

pytest.importorskip("deepspeed")

GLOBAL_BATCH = 8
STEPS = 10
DP = 2
BF16_RTOL = 2e-2
WEIGHT_ATOL = 5e-5  # after 10 AdamW steps, reduction-order noise on near-zero gradients moves single elements ~2e-5


def _nanogpt() -> L.LightningModule:
    return NanoGPTModule(n_layer=2, n_head=2, n_embd=32)


MODELS: dict[str, Callable[[], L.LightningModule]] = {"nanogpt": _nanogpt, "llama": LlamaModule, "gpt2": GPT2Module}


class _NanoGPTWithSchedule(NanoGPTModule):
    """nanoGPT with a per-step LR schedule from ``configure_optimizers``: Lightning steps it, the engine must not."""

    @override
    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# Modules run beside MODELS in a few configurations only.
EXTRA_MODELS: dict[str, Callable[[], L.LightningModule]] = {
    "nanogpt-lr-schedule": lambda: _NanoGPTWithSchedule(n_layer=2, n_head=2, n_embd=32)
}


def _data(batch_size: int) -> Callable[[], L.LightningDataModule]:
    return lambda: RandomTokenDataModule(batch_size=batch_size)


@functools.cache
def _compile_deepspeed_ops() -> None:
    """Compile (first use on a machine) or load DeepSpeed's CPU comm op here, not in racing ranks."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)
    # The engine imports DeepSpeed's Muon optimizer at its first set-up, which runs torch.compile at import (~4 s of
    # CPU in torch._inductor): imported once here, the forked ranks inherit it instead of each importing it.
    with contextlib.suppress(ImportError):
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")


def _fits(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several fits one after another in this rank (the process group and DeepSpeed's set-up are reused)."""
    results = []
    for run in runs:
        after_fit = run.get("after_fit")
        if run.get("fp16_on_cpu"):
            _allow_fp16_on_cpu()
        results.append(
            _fit_worker(
                {**MODELS, **EXTRA_MODELS}[run["model"]],
                _data(GLOBAL_BATCH // run["devices"]),
                run.get("strategy"),
                run["devices"],
                run.get("steps", STEPS),
                1234,
                run.get("trainer", {}),
                run.get("callbacks"),
                run.get("fit"),
                after_fit,
            )
        )
    return results


def _allow_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 where oneDNN has no fp16 kernels (this CPU); torch computes fp16 there anyway, so
    the test lifts the check in its worker process (exited after the test) to exercise the fp16 loss scaler."""
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True


def _run(devices: int, runs: list[dict[str, Any]]) -> list[RunResult]:
    _compile_deepspeed_ops()
    for run in runs:
        run["devices"] = devices
    outputs = run_distributed(_fits, devices, runs, timeout=600)
    return [RunResult(o["losses"], o["state_dict"], o["extra"]) for o in outputs[0]]


SHARDED = {"checkpoint_format": "sharded"}


def _ds(stage: int, **kwargs: Any) -> dict[str, Any]:
    return {"zero_backend": "deepspeed", "zero_stage": stage, **kwargs}


def _fp16() -> dict[str, Any]:
    """fp16 on CPU, one plugin per fit: the explicit plugin (Lightning runs Trainer(precision="16-mixed") as bf16)."""
    return {"plugins": [HybridPrecision("16-mixed")]}


# ------------------------------------------------------------------------------------------------------ teardown
def _structure(module: L.LightningModule) -> dict[str, Any]:
    """What DeepSpeed changes in place: each submodule's class, attributes, hooks, parameter dict and objects, and
    each parameter's attributes (the LightningModule's own attributes are Lightning's business)."""
    subs = {
        name: (
            type(sub),
            type(sub._parameters),
            frozenset(vars(sub)),
            [len(getattr(sub, a)) for a in vars(sub) if "hook" in a and isinstance(getattr(sub, a), dict)],
            {k: id(p) for k, p in sub._parameters.items()},
        )
        for name, sub in module.named_modules()
        if name
    }
    params = {name: (frozenset(vars(p)), p.dtype, tuple(p.shape)) for name, p in module.named_parameters()}
    return {"modules": subs, "params": params}


class _StructureBeforeSetup(L.Callback):
    """Records the module before the strategy's setup (Lightning calls callbacks' ``setup`` first)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.before = _structure(pl_module)


def _check_given_back(trainer: L.Trainer) -> None:
    module, optimizer = trainer.lightning_module, trainer.optimizers[0]
    before = next(c for c in trainer.callbacks if isinstance(c, _StructureBeforeSetup)).before
    assert _structure(module) == before
    params = list(module.parameters())
    assert sorted(id(p) for group in optimizer.param_groups for p in group["params"]) == sorted(map(id, params))
    assert all(optimizer.state[p]["exp_avg"].shape == p.shape for p in params)
    assert "zero_grad" not in vars(optimizer)  # routed to DeepSpeed's optimizer during fit, given back


# ------------------------------------------------------------------------------------------------ equivalence
BF16 = {"precision": "bf16-mixed"}
KNOBS = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def references() -> dict[str, RunResult]:
    """Every one-process run the module compares against, in one spawn: each model in fp32 and bf16-mixed, Llama
    with accumulation and clipping."""
    runs = {model: {"model": model} for model in [*sorted(MODELS), *EXTRA_MODELS]}
    runs |= {f"{model}-bf16": {"model": model, "trainer": BF16} for model in sorted(MODELS)}
    runs["llama-knobs"] = {"model": "llama", "trainer": KNOBS}
    return dict(zip(runs, _run(1, list(runs.values()))))


# The user's own optimizer with DeepSpeed's CPU offload: DeepSpeed insists on its DeepSpeedCPUAdam unless told not to.
OFFLOAD_OPTIMIZER = {
    "zero_force_ds_cpu_optimizer": False,
    "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
}
OFFLOAD_BOTH = {
    "zero_force_ds_cpu_optimizer": False,
    "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}
# Beyond every model at stages 1-3: ZeRO-0, offloading (a config section that passes through) at 2 and 3, and an LR
# scheduler from configure_optimizers.
EXTRA_RUNS = {
    ("nanogpt", "zero-0"): _ds(0),
    ("nanogpt", "zero-2 offload_optimizer"): _ds(2, deepspeed_config=OFFLOAD_OPTIMIZER),
    ("nanogpt", "zero-3 offload_optimizer+param"): _ds(3, deepspeed_config=OFFLOAD_BOTH),
    ("nanogpt-lr-schedule", "zero-2"): _ds(2),
}


@pytest.fixture(scope="module")
def stage_results() -> dict[tuple[str, Any], RunResult]:
    """Every model at every stage, and ``EXTRA_RUNS``, dp 2, in one spawn; after fit each checks the module and
    optimizer it gets back."""
    strategies = {(model, stage): _ds(stage) for model in sorted(MODELS) for stage in STAGES} | EXTRA_RUNS
    runs = [
        {
            "model": model,
            "strategy": strategy,
            "after_fit": _check_given_back,
            "callbacks": lambda: [_StructureBeforeSetup()],
        }
        for (model, _), strategy in strategies.items()
    ]
    return dict(zip(strategies, _run(DP, runs)))


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.slow  # the slow tier: the optional DeepSpeed backend trained against one process
def test_stages_train_like_one_process(model, references, stage_results):
    """Each stage like one process; after fit (teardown) the module holds the trained weights as plain tensors,
    with DeepSpeed's attributes, hooks and gathering parameter dicts gone, and the user's optimizer holds its
    parameters and their whole states (``_check_given_back``)."""
    for stage in STAGES:
        try:
            assert_same_training(references[model], stage_results[model, stage], weight_atol=WEIGHT_ATOL)
        except AssertionError as error:
            raise AssertionError(f"{model} at DeepSpeed ZeRO-{stage}: {error}") from None


@pytest.mark.slow  # the slow tier: the optional DeepSpeed backend trained against one process
def test_zero_0_cpu_offload_and_lr_schedule_train_like_one_process(references, stage_results):
    """ZeRO-0; the user's optimizer with DeepSpeed's CPU offload (optimizer at ZeRO-2, optimizer and parameters at
    ZeRO-3: the offload sections pass through to the engine); a per-step LR schedule (ZeRO-2): like one process."""
    assert references["nanogpt-lr-schedule"].losses != references["nanogpt"].losses  # the schedule changes the run
    for model, name in EXTRA_RUNS:
        try:
            assert_same_training(references[model], stage_results[model, name], weight_atol=WEIGHT_ATOL)
        except AssertionError as error:
            raise AssertionError(f"{model} at DeepSpeed {name}: {error}") from None


@pytest.mark.slow  # the slow tier: the optional DeepSpeed backend trained against one process
def test_bf16_mixed_accumulation_and_clipping_follow_the_trainer(references):
    """bf16-mixed (DeepSpeed bf16 with fp32 masters), every model at every stage, within 2e-2;
    accumulate_grad_batches and gradient_clip_val from the Trainer act exactly as on one process (fp32)."""
    assert references["llama-knobs"].losses != references["llama"].losses  # accumulation and the clip change the run
    cases = [(model, stage) for model in sorted(MODELS) for stage in STAGES]
    runs = [{"model": model, "strategy": _ds(stage), "trainer": BF16} for model, stage in cases]
    *bf16, knobs = _run(DP, [*runs, {"model": "llama", "strategy": _ds(3), "trainer": KNOBS}])
    for (model, stage), result in zip(cases, bf16):
        reference = torch.tensor(references[f"{model}-bf16"].losses)
        torch.testing.assert_close(
            torch.tensor(result.losses), reference, rtol=BF16_RTOL, atol=0.0, msg=f"{model} at ZeRO-{stage}"
        )
    assert_same_training(references["llama-knobs"], knobs, weight_atol=WEIGHT_ATOL)


# ------------------------------------------------------------------------------------------------------ memory
class DeepSpeedMemoryProbe(L.Callback):
    """Bytes one rank holds right after backward at step 1: module parameters (its ZeRO-3 partition), gradients
    (whole, or DeepSpeed's reduced partitions), optimizer (states and DeepSpeed's fp32 master partitions)."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != 1:
            return
        from lightning_mgpu.backends.deepspeed import memory_per_rank

        sizes = [getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters()]
        self.results = {
            "numel": sum(sizes),
            "largest_numel": max(sizes),
            **memory_per_rank(trainer.strategy.model, pl_module, optimizer),
        }


class TorchMemoryProbe(MemoryProbe):
    """The same three numbers for the torch backend (local shards, their gradients, the optimizer's states)."""

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if self.results and "params" not in self.results:
            self.results.update({k: self.results.pop(f"{k.rstrip('s')}_bytes") for k in ("params", "grads", "optim")})


# The torch backend at the same point (tests/parallel/data/test_wrap.py): no fp32 master copy; ZeRO-1 under DDP keeps
# whole parameters and gradients, FSDP2 (ZeRO-2/3) has resharded both by then.
TORCH_BYTES_PER_PARAM = {1: lambda dp: 8 + 8 / dp, 2: lambda dp: 16 / dp, 3: lambda dp: 16 / dp}
PADDING = 0.02  # DeepSpeed pads partitions to an alignment
# ZeRO-1/2 keep the reduced gradients of every parameter that overlaps the partition, whole: up to one more tensor.
WHOLE_PARAMS = {(1, "grads"), (2, "grads")}


@pytest.mark.slow  # the slow tier: the optional DeepSpeed backend trained against one process
def test_memory_per_rank_follows_zero_formulas(capsys):
    """DeepSpeed's parameters, gradients and optimizer state per rank after backward follow the ZeRO formulas
    (K = 12, ``zero_bytes_per_param``); the torch backend's, measured in the same spawn, are printed beside."""
    from lightning_mgpu.backends.deepspeed import zero_bytes_per_param

    stages = (1, 2, 3)
    runs = [
        {"model": "nanogpt", "strategy": _ds(stage), "steps": 2, "callbacks": lambda: [DeepSpeedMemoryProbe()]}
        for stage in stages
    ]
    runs += [
        {"model": "nanogpt", "strategy": {"zero_stage": stage}, "steps": 2, "callbacks": lambda: [TorchMemoryProbe()]}
        for stage in stages
    ]
    results = _run(DP, runs)
    lines = [f"bytes/param per rank after backward, dp={DP}, fp32 AdamW: params + grads + optimizer = total"]
    for stage, ours, torch_backend in zip(stages, results[:3], results[3:]):
        measured, numel = ours.extra, ours.extra["numel"]
        formula = zero_bytes_per_param(stage, DP)
        for kind, per_param in formula.items():
            expected = per_param * numel
            if (stage, kind) in WHOLE_PARAMS:
                assert expected <= measured[kind] <= expected + 4 * measured["largest_numel"], (stage, kind, measured)
            else:
                assert measured[kind] == pytest.approx(expected, rel=PADDING), (stage, kind, measured)
        theirs = torch_backend.extra
        torch_total = sum(theirs[k] for k in formula) / theirs["numel"]
        assert theirs["numel"] == numel
        assert torch_total == pytest.approx(TORCH_BYTES_PER_PARAM[stage](DP), abs=8 * theirs["largest_numel"] / numel)
        row = lambda held: " + ".join(f"{held[k] / numel:.2f}" for k in formula)
        lines.append(
            f"ZeRO-{stage}: deepspeed {row(measured)} = {sum(measured[k] for k in formula) / numel:.2f}"
            f" (formula {sum(formula.values()):.2f}); torch backend {row(theirs)} = {torch_total:.2f}"
            f" (formula {TORCH_BYTES_PER_PARAM[stage](DP):.2f})"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------- checkpoints
def _save_to(path: str) -> Callable[[L.Trainer], None]:
    return lambda trainer: trainer.save_checkpoint(path)


class _SaveAt(L.Callback):
    """Saves at the end of a training step, while the DeepSpeed engine holds the states (as ModelCheckpoint does;
    a save after `fit` reads the plain module given back)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _saving_at(step: int, path: str) -> Callable[[], list[L.Callback]]:
    return lambda: [_SaveAt(step, path)]


@pytest.mark.slow  # the slow tier: the optional DeepSpeed backend trained against one process
def test_checkpoints_cross_backends_and_resume_exactly(tmp_path, references, stage_results):
    """DeepSpeed ZeRO-2 -> torch ZeRO-3, torch ZeRO-1 -> DeepSpeed ZeRO-3 and DeepSpeed ZeRO-3 -> torch ZeRO-2
    continue the uninterrupted run; DeepSpeed -> DeepSpeed continues it exactly (the uninterrupted ZeRO-2 run is
    ``stage_results``'); each rank wrote only its pieces (``_check_written_by_pieces``); `consolidate`/`inspect`
    read a DeepSpeed checkpoint."""
    half = STEPS // 2
    ds_ckpt, torch_ckpt, ds3_ckpt = (str(tmp_path / name) for name in ("ds2.ckpt", "torch1.ckpt", "ds3.ckpt"))
    model = "gpt2"
    reference = references[model]
    results = _run(
        DP,
        [
            # Sharded (directories): each rank's pieces are checked below; the default format is one file.
            {
                "model": model,
                "strategy": _ds(2, checkpoint_format="sharded"),
                "steps": half,
                "callbacks": _saving_at(half, ds_ckpt),
            },
            {"model": model, "strategy": {"zero_stage": 3}, "fit": {"ckpt_path": ds_ckpt}},
            {"model": model, "strategy": {"zero_stage": 1}, "steps": half, "after_fit": _save_to(torch_ckpt)},
            {"model": model, "strategy": _ds(3), "fit": {"ckpt_path": torch_ckpt}},
            {
                "model": model,
                "strategy": _ds(3, checkpoint_format="sharded"),
                "steps": half,
                "callbacks": _saving_at(half, ds3_ckpt),
            },
            {"model": model, "strategy": {"zero_stage": 2}, "fit": {"ckpt_path": ds3_ckpt}},
            {"model": model, "strategy": _ds(2), "fit": {"ckpt_path": ds_ckpt}},
        ],
    )
    ds_first, torch_after_ds, torch_first, ds_after_torch, ds3_first, torch_after_ds3, ds_after_ds = results
    ds_whole = stage_results[model, 2]
    for first, second in ((ds_first, torch_after_ds), (torch_first, ds_after_torch), (ds3_first, torch_after_ds3)):
        assert_same_training(
            reference, RunResult(first.losses + second.losses, second.state_dict), weight_atol=WEIGHT_ATOL
        )
    assert ds_after_ds.losses == ds_whole.losses[half:]  # bit for bit within the backend
    for key, value in ds_whole.state_dict.items():
        assert torch.equal(ds_after_ds.state_dict[key], value), key
    _check_written_by_pieces(tmp_path / "ds3.ckpt", every_tensor=True)
    _check_written_by_pieces(tmp_path / "ds2.ckpt", every_tensor=False)

    from lightning_mgpu.checkpoint import consolidate, describe

    full = consolidate(tmp_path / "ds2.ckpt")
    assert set(full["state_dict"]) == set(reference.state_dict)
    assert "state.model.transformer.h.0.attn.c_attn.weight.exp_avg" in json.dumps(list(_flat_keys(full)))
    assert "model.transformer.wte.weight" in describe(tmp_path / "ds2.ckpt")


def _check_written_by_pieces(path: Any, every_tensor: bool) -> None:
    """Each rank wrote its own piece of the parameters and their optimizer states (several chunks per tensor),
    not whole gathered tensors: under ZeRO-3 every tensor is cut between the ranks, under ZeRO-2 the tensors that
    straddle the partition boundary."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    cut = {
        key: len(entry.chunks)
        for key, entry in metadata.state_dict_metadata.items()
        if key.endswith((".weight", ".exp_avg", ".exp_avg_sq")) and hasattr(entry, "chunks") and entry.size.numel() > 1
    }
    assert cut, sorted(metadata.state_dict_metadata)
    if every_tensor:
        assert all(chunks >= DP for chunks in cut.values()), cut
    else:
        assert any(chunks >= DP for chunks in cut.values()), cut
    assert {info.relative_path.split("_")[2] for info in metadata.storage_data.values()} == {"0", "1"}


class _LossScale(L.Callback):
    """DeepSpeed's loss scale and skipped-step count after every optimizer step."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {"scales": [], "skipped": 0}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        engine = trainer.strategy.model
        self.results["scales"].append(float(engine.optimizer.loss_scaler.cur_scale))
        self.results["skipped"] = engine.skipped_steps


@pytest.mark.slow  # the slow tier: the optional DeepSpeed backend trained against one process
def test_fp16_resume_continues_the_loss_scaler(tmp_path):
    """16-mixed: DeepSpeed's dynamic loss scaler (scale, window and hysteresis counters, skipped steps) is saved
    and restored, so a resumed fp16 run skips and rescales exactly where the uninterrupted one did."""
    half, ckpt = 3, str(tmp_path / "fp16.ckpt")
    # A high first scale that overflows and a short window: the scale moves both ways within the run.
    config = {"fp16": {"initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 1}}
    run = {
        "model": "llama",
        "strategy": _ds(2, deepspeed_config=config),
        "fp16_on_cpu": True,
        "callbacks": lambda: [_LossScale()],
    }
    whole, first, resumed = _run(
        DP,
        [
            {**run, "trainer": _fp16()},
            {**run, "trainer": _fp16(), "steps": half, "after_fit": _save_to(ckpt)},
            {**run, "trainer": _fp16(), "fit": {"ckpt_path": ckpt}},
        ],
    )
    scales = whole.extra["scales"]
    # The scaler has state to lose: at the save its scale is not the first one, and steps were skipped.
    assert whole.extra["skipped"] > 0 and scales[half - 1] != scales[0], scales
    assert first.extra["scales"] + resumed.extra["scales"] == scales
    assert resumed.extra["skipped"] == whole.extra["skipped"]
    assert first.losses + resumed.losses == whole.losses  # bit for bit


def _flat_keys(full: dict[str, Any]) -> list[str]:
    from lightning_mgpu.checkpoint.states import native_to_flat

    groups = full["lightning_mgpu"]["optimizer_param_groups"][0]
    return list(native_to_flat(full["optimizer_states"][0], groups))


# ------------------------------------------------------------------------------------------ refused before launch
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(zero_stage=3, deepspeed_config={"zero_optimization": {"stage": 2}}),
            r"zero_optimization.stage=2 but HybridStrategy has zero_stage=3",
        ),
        (
            dict(zero_stage=3, deepspeed_config={"zero_optimization": {"offload_param": {"device": "nvme"}}}),
            r"offloads to NVMe .* without a path. Add zero_optimization.offload_param.nvme_path",
        ),
        (
            dict(zero_stage=2, deepspeed_config={"zero_optimization": {"offload_param": {"device": "cpu"}}}),
            r"offloads parameters .* at ZeRO stage 3 only",
        ),
        (
            dict(zero_stage=2, deepspeed_config={"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}),
            r"zero_optimization.offload_optimizer.device='nvme'\) without a path",
        ),
        (
            dict(zero_stage=2, deepspeed_config={"zero_optimization": {"reduce_bucket_sise": 5}}),
            r"not valid for DeepSpeed: reduce_bucket_sise: Extra inputs are not permitted",
        ),
        (
            dict(zero_stage=2, deepspeed_config={"zero_optimisation": {"stage": 2}}),
            r"top-level key 'zero_optimisation', which DeepSpeed \S+ does not read .* Did you mean 'zero_optimization'",
        ),
        (
            dict(zero_stage=3, deepspeed_config={"gradient_allreduce_op": "sum"}),
            r"not valid for DeepSpeed \S+: gradient_allreduce_op='sum' is not supported with ZeRO stage 3",
        ),
        (dict(deepspeed_config={"amp": {"enabled": True}}), r"not valid for DeepSpeed \S+: NVIDIA Apex AMP .* removed"),
        (dict(pipeline_parallel_size=2, zero_stage=1), r"pipeline_parallel_size=2 would need DeepSpeed's own"),
        (dict(deepspeed_config={"optimizer": {"type": "Adam"}}), r"optimizer comes from the LightningModule"),
        (dict(tensor_parallel_size=2), r"tensor_parallel_size=2 shards parameters as DTensors"),
        (dict(pipeline_parallel_size=2, zero_stage=3), r"pipeline_parallel_size=2 would need DeepSpeed's own"),
        (dict(cpu_offload=True, zero_stage=3), r"put .*offload_optimizer.* in deepspeed_config"),
        (dict(deepspeed_config="/nonexistent/ds.json"), r"is not a file"),
    ],
)
def test_invalid_configs_are_refused_when_the_strategy_is_built(kwargs, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        HybridStrategy(zero_backend="deepspeed", **kwargs)


def test_deepspeed_config_needs_the_deepspeed_backend():
    with pytest.raises(ValueError, match=r"needs zero_backend='deepspeed', got zero_backend='torch'"):
        HybridStrategy(deepspeed_config={})


def _cpu_has_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


CONTRADICTIONS = [
    (
        {"gradient_accumulation_steps": 4},
        {"accumulate_grad_batches": 2},
        r"gradient_accumulation_steps=4 but Trainer\(accumulate_grad_batches\) gives 2",
    ),
    ({"gradient_clipping": 1.0}, {}, r"gradient_clipping=1.0 but Trainer\(gradient_clip_val\) gives 0.0"),
    (
        {"bf16": {"enabled": True}},
        {"precision": "32-true"},
        r"bf16.enabled=True but Trainer\(precision='32-true'\) means bf16.enabled=False",
    ),
    ({}, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, r"clips by the global norm only"),
    ({"train_micro_batch_size_per_gpu": 16}, {}, r"train_micro_batch_size_per_gpu=16 but the train dataloader"),
    (
        {"train_batch_size": 64},
        {},
        r"train_batch_size=64 but batch_size x accumulate_grad_batches x data_parallel_size gives 8",
    ),
    (
        {"fp16": {"enabled": True}},
        {"precision": "bf16-mixed"},
        r"fp16.enabled=True but Trainer\(precision='bf16-mixed'\) means fp16.enabled=False",
    ),
]
if not _cpu_has_fp16():  # then 16-mixed is refused before training, naming the alternatives
    CONTRADICTIONS.append(({}, _fp16(), r"not support on this cpu device. Use precision='bf16-mixed'"))


class _StepCounter(L.Callback):
    steps = 0

    def on_train_batch_start(self, *args: Any) -> None:
        _StepCounter.steps += 1


def _fit_errors(runs: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """Each fit's error message and how many training steps had started when it was raised."""
    errors = []
    for run in runs:
        _StepCounter.steps = 0
        try:
            _fits([{**run, "callbacks": lambda: [_StepCounter()]}])
            errors.append(("no error", _StepCounter.steps))
        except Exception as error:
            errors.append((str(error), _StepCounter.steps))
    return errors


def test_configs_contradicting_the_trainer_fail_before_training():
    runs = [
        {"model": "llama", "strategy": _ds(1, deepspeed_config=config), "trainer": trainer, "devices": 1}
        for config, trainer, _ in CONTRADICTIONS
    ]
    (errors,) = run_distributed(_fit_errors, 1, runs, timeout=600)
    for (message, steps), (_, _, match) in zip(errors, CONTRADICTIONS):
        assert re.search(match, message), (match, message)
        assert steps == 0, (match, steps)


def test_config_file_passes_through(tmp_path):
    from lightning_mgpu.backends.deepspeed import build_config

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"zero_optimization": {"reduce_bucket_size": 1000, "offload_optimizer": {"device": "cpu"}}})
    )
    config = build_config(str(path), 2, "bf16-mixed", None, None, 1, 4, 2)
    assert config["zero_optimization"] == {
        "reduce_bucket_size": 1000,
        "offload_optimizer": {"device": "cpu"},
        "stage": 2,
    }
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["train_batch_size"] == 8 and config["gradient_clipping"] == 0.0
    assert "zero_allow_untested_optimizer" not in config  # a given config gets none of Lightning's defaults


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_config_gets_lightnings_deepspeed_strategy_settings(stage):
    """Without a deepspeed_config the engine is configured as Lightning's DeepSpeedStrategy(stage=N) configures
    it (read from Lightning itself, so a change there fails here); an empty config keeps DeepSpeed's defaults."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_mgpu.backends.deepspeed import build_config

    lightning = DeepSpeedStrategy(stage=stage).config
    ours = build_config(None, stage, "32-true", None, None, 1, 4, 2)
    assert ours["zero_optimization"] == lightning["zero_optimization"]
    assert ours["zero_allow_untested_optimizer"] == lightning["zero_allow_untested_optimizer"]
    assert build_config({}, stage, "32-true", None, None, 1, 4, 2)["zero_optimization"] == {"stage": stage}
