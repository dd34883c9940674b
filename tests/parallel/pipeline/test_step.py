"""The pipeline runtime's contracts: torch internals it needs, the split undone, no host sync per microbatch."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_mgpu._compat.tensors import TorchDispatchMode
from lightning_mgpu.demo import GPTLightningModule, TextDataModule
from tests.helpers.equivalence import fit


def test_the_torch_internals_the_runtime_uses_exist():
    from lightning_mgpu._compat import pipelining

    pipelining.check()  # raises naming what is missing after a torch upgrade


def test_unsplit_and_remove_give_the_user_module_back():
    from lightning_mgpu.parallel.pipeline.capture import StepCapture
    from lightning_mgpu.parallel.pipeline.plan import plan_split
    from lightning_mgpu.parallel.pipeline.split import PipelineRuntime

    module = GPTLightningModule(block_size=16, n_layer=4, n_head=2, n_embd=16)
    before = dict(module.named_modules())
    forwards = {name: vars(m).get("forward") for name, m in before.items()}
    x = torch.randint(0, 64, (2, 16))
    expected = module(x)
    for stages in ([0], [1]):
        runtime = PipelineRuntime(module, plan_split(module, 2, "auto"), stages, 2)
        assert dict(module.named_modules()) != before  # stand-ins replaced the other stage's modules
        runtime.unsplit(module)
        assert dict(module.named_modules()) == before
        assert {name: vars(m).get("forward") for name, m in module.named_modules()} == forwards
        torch.testing.assert_close(module(x), expected, rtol=0, atol=0)
    path = [module, module.model, module.model.transformer]  # the engine's: the modules down to the blocks
    capture = StepCapture(module, path)
    calls = capture.capture_all([lambda k=k: module.training_step((x[k : k + 1], x), 0) for k in range(2)])
    assert [c.module for c in calls] == [module, module] and torch.equal(calls[1].args[0], x[1:])
    assert "log" not in vars(module) and "log_dict" not in vars(module)
    # Replay: the step's network call returns the given output, its logs are recorded; the user's own instance
    # attributes (a `log` set on the instance, no instance `forward`) are as they were after.
    from lightning_mgpu.parallel.pipeline.publish import StepLogs

    module.log = own_log = lambda *args, **kwargs: None
    logs = StepLogs()
    logits = torch.zeros(2, 16, 64)
    loss = capture.replay(calls[0], logits, lambda: module.training_step((x, x), 0), logs)
    torch.testing.assert_close(loss, torch.tensor(64.0).log())  # uniform logits over 64 tokens
    assert [name for name, _, _ in logs.values] == ["train_loss"]
    assert vars(module)["log"] is own_log and "forward" not in vars(module) and "log_dict" not in vars(module)
    del module.log
    # A second network call in a replay is refused, and the interception is undone all the same.
    twice = lambda: (module(x), module.model(x))
    with pytest.raises(RuntimeError, match="GPT was called again"):
        capture.replay(calls[0], logits, twice, StepLogs())
    assert not any(m._forward_pre_hooks for m in module.modules())
    assert not any("forward" in vars(m) for m in path) and "log" not in vars(module) and "log_dict" not in vars(module)


def test_logged_means_are_float64_means_of_every_microbatch_value():
    """Publishing averages each logged name over the microbatches in float64, whatever was logged: plain scalar
    tensors (stacked in one op), mixed dtypes, large integers and Python numbers (converted one by one)."""
    from lightning_mgpu.parallel.pipeline.publish import StepLogs

    logs = StepLogs()
    logged = {
        "f32": [torch.tensor(0.1), torch.tensor([0.2]), torch.tensor(0.4)],
        "mixed": [torch.tensor(0.1, dtype=torch.bfloat16), torch.tensor(0.3)],
        "big_int": [torch.tensor(2**40 + 1), torch.tensor(0.5)],  # stacked together: float32, 2**40 + 1 lost
        "with_number": [torch.tensor(2**40 + 3), 1],
        "number": [1, 2.5],
    }
    for name, values in logged.items():
        for value in values:
            logs.record(name, value, {"prog_bar": name == "f32"})
    means = logs.means(torch.device("cpu"))
    assert list(means) == list(logged)
    for name, values in logged.items():
        expected = sum(float(v) for v in values) / len(values)  # each value read exactly, as float64 holds it
        mean, options = means[name]
        assert mean.dtype == torch.float64 and mean.dim() == 0 and not mean.requires_grad
        assert mean.item() == expected, (name, mean.item(), expected)
        assert options == {"prog_bar": name == "f32"}


class _HostSyncs(L.Callback):
    """Counts reads of device values into Python (``item()``, ``int()``, ``bool()``, ``float()``) per training step."""

    def __init__(self) -> None:
        self.results: dict[str, list[int]] = {"syncs": []}

    def on_train_batch_start(self, *args) -> None:
        self._mode = _CountScalarReads()
        self._mode.__enter__()

    def on_train_batch_end(self, *args) -> None:
        self._mode.__exit__(None, None, None)
        self.results["syncs"].append(self._mode.count)


class _CountScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_host_syncs_per_step_do_not_grow_with_the_number_of_microbatches():
    def module():
        return GPTLightningModule(block_size=16, n_layer=2, n_head=2, n_embd=16)

    counts = {}
    for microbatches in (2, 8):
        strategy = {"pipeline_parallel_size": 2, "num_microbatches": microbatches}
        _, extras = fit(
            module,
            lambda: TextDataModule(batch_size=8, block_size=16),
            strategy,
            2,
            3,
            callbacks_factory=lambda: [_HostSyncs()],
        )
        counts[microbatches] = [rank["syncs"][1:] for rank in extras]  # after the shape-inference step
    assert counts[2] == counts[8], counts
