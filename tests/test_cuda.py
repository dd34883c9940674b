"""The GPU-only paths, on one CUDA device: skipped here (no CUDA in CI), run by ``python -m benchmarks.gpu_check``
when a GPU is lent. Each compares against the same thing on CPU or against one process, as the CPU suite does."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_mgpu import HybridStrategy, ScalingMonitor
from lightning_mgpu.demo import GPTLightningModule, TextDataModule

pytestmark = pytest.mark.cuda
STEPS = 5


def _fit(
    precision: str,
    strategy: Any = None,
    callbacks: list | None = None,
    devices: int = 1,
    ckpt_path: str | None = None,
    max_steps: int = STEPS,
    **trainer: Any,
) -> L.Trainer:
    L.seed_everything(1234)
    module = GPTLightningModule(block_size=64, n_layer=2, n_head=4, n_embd=128)
    fit_trainer = L.Trainer(
        accelerator="cuda", devices=devices, strategy=strategy or HybridStrategy(), precision=precision,
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks or [], **trainer,
    )  # fmt: skip
    fit_trainer.fit(module, TextDataModule(batch_size=8 // devices, block_size=64), ckpt_path=ckpt_path)
    return fit_trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_cuda_precisions_train_like_lightnings_single_device(precision):
    """HybridStrategy at devices=1 on CUDA: the same losses as Lightning's own single-device strategy."""
    ours = _fit(precision).callback_metrics["train_loss"].item()
    theirs = _fit(precision, strategy="auto").callback_metrics["train_loss"].item()
    assert ours == pytest.approx(theirs, rel=2e-2)


def test_cuda_monitor_reads_cuda_events_and_memory(tmp_path):
    monitor = ScalingMonitor(dirpath=tmp_path, verbose=False)
    _fit("bf16-mixed", callbacks=[monitor])
    report = monitor.report
    assert report["memory"][0]["peak_kind"] == "cuda max_memory_allocated"
    assert report["throughput"]["tokens_per_s"] > 0 and 0 < report["throughput"]["mfu"] < 1


def test_cuda_tensors_checkpoint_and_resume(tmp_path):
    """Sharded (DCP) and full checkpoints of CUDA tensors, written and resumed on the GPU."""
    for fmt in ("sharded", "full"):
        whole = _fit("32-true", HybridStrategy(checkpoint_format=fmt), max_steps=2 * STEPS)
        first = _fit("32-true", HybridStrategy(checkpoint_format=fmt))
        first.save_checkpoint(tmp_path / fmt)
        resumed = _fit("32-true", HybridStrategy(checkpoint_format=fmt), ckpt_path=str(tmp_path / fmt),
                       max_steps=2 * STEPS)  # fmt: skip
        loss = resumed.callback_metrics["train_loss"].item()
        assert loss == pytest.approx(whole.callback_metrics["train_loss"].item(), rel=1e-4), fmt


def test_cuda_async_checkpoint_uses_pinned_memory(tmp_path):
    trainer = _fit("bf16-mixed", HybridStrategy(async_checkpoint=True))
    trainer.save_checkpoint(tmp_path / "async.ckpt")
    trainer.strategy.teardown()  # waits for the background save
    assert (tmp_path / "async.ckpt").exists()
    resumed = _fit("bf16-mixed", HybridStrategy(), ckpt_path=str(tmp_path / "async.ckpt"), max_steps=STEPS + 1)
    assert resumed.global_step == STEPS + 1


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="Lightning gives each process its own device: two processes need two GPUs",
)
def test_cuda_two_processes_over_gloo():
    """dp 2 over gloo on CUDA tensors (``cpu:gloo,cuda:gloo``): trains and matches one process."""
    one = _fit("32-true").callback_metrics["train_loss"].item()
    two = _fit("32-true", HybridStrategy(process_group_backend="cpu:gloo,cuda:gloo", start_method="fork"), devices=2)
    assert two.callback_metrics["train_loss"].item() == pytest.approx(one, rel=1e-4)


def test_cuda_compile_trains(tmp_path):
    compiled = _fit("bf16-mixed", HybridStrategy(compile=True)).callback_metrics["train_loss"].item()
    eager = _fit("bf16-mixed").callback_metrics["train_loss"].item()
    assert compiled == pytest.approx(eager, rel=2e-2)


# ------------------------------------------------- the CUDA-only branches (docs/guides/gpus.md lists them all)
@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_cuda_context_parallel_kernels_match_sdpa(kernel):
    """Each fused CUDA kernel this GPU has, through the ring (a ring of one rank: two chunks, merged by their
    log-sum-exp) and the all-to-all's block attention, against SDPA on the whole sequence in fp32 (bf16 inputs,
    grouped-query heads, causal)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_mgpu.parallel.context import ring_attention
    from lightning_mgpu.parallel.context.attention import block_attention
    from lightning_mgpu.parallel.context.kernels import kernel_for
    from tests.helpers.distributed import one_rank_group

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(2, h, 256, 64, device="cuda", generator=g).bfloat16() for h in (8, 2, 2, 8))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    wanted = [expected, *torch.autograd.grad(expected, leaves, grad.float())]
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}.get(
        kernel, SDPBackend.CUDNN_ATTENTION
    )
    with one_rank_group("cuda") as group, sdpa_kernel([backend]):
        choice = kernel_for(q[:, :, :128], k[:, :, :128], v[:, :, :128], True)
        if choice.kernel != kernel:
            pytest.skip(f"{kernel} does not take this block here: {choice.reason}")
        for attention in (lambda *t: ring_attention(*t, True, None, group), lambda *t: block_attention(*t, True)):
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attention(*inputs)
            got = [out, *torch.autograd.grad(out, inputs, grad)]
            for mine, theirs in zip(got, wanted):
                error = float((mine.float() - theirs).norm() / theirs.norm())
                assert error < 2e-2, (kernel, error)


def test_cuda_device_as_the_kernel_choice_reads_it():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_mgpu.parallel.context.kernels import device_of

    device = device_of(torch.device("cuda", 0))
    assert device.capability == torch.cuda.get_device_capability(0)
    assert ("flash" in device.enabled) == torch.backends.cuda.is_flash_attention_available()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert device_of(torch.device("cuda", 0)).enabled == frozenset({"efficient"})


def test_cuda_shard_local_step_equals_the_dtensor_step():
    """AdamW on CUDA DTensor parameters: ``ShardLocalStep`` leaves the parameters the DTensor path leaves (on CUDA
    torch's own foreach step runs on the local shards; the fused CPU step is for CPU tensors only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_mgpu.parallel.local_step import ShardLocalStep
    from tests.helpers.distributed import one_rank_group

    with one_rank_group("cuda"):
        mesh = init_device_mesh("cuda", (1,))
        results = []
        for local in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            params = [
                torch.nn.Parameter(distribute_tensor(torch.randn(s, device="cuda", generator=g), mesh, [Shard(0)]))
                for s in ((256, 64), (64,))
            ]
            optimizer = torch.optim.AdamW(params, lr=1e-2)
            wrapper = ShardLocalStep(optimizer) if local else None
            for _ in range(3):
                for p in params:
                    p.grad = distribute_tensor(torch.randn(p.shape, device="cuda", generator=g), mesh, [Shard(0)])
                optimizer.step()
            if wrapper is not None:
                wrapper.remove()
            results.append([p.detach().full_tensor() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class _Pinned(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        from torch.distributed.tensor import DTensor

        for p in pl_module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            self.seen.append((local.device.type, local.is_pinned()))


def test_cuda_cpu_offload_pins_host_memory():
    """ZeRO-3 with ``cpu_offload=True`` on a GPU: FSDP2's offload policy with pinned host memory (there is none to
    pin without CUDA), training like without offloading."""
    pinned = _Pinned()
    offloaded = _fit("32-true", HybridStrategy(zero_stage=3, cpu_offload=True), callbacks=[pinned])
    assert pinned.seen and all(kind == "cpu" and is_pinned for kind, is_pinned in pinned.seen), pinned.seen[:4]
    plain = _fit("32-true", HybridStrategy(zero_stage=3))
    loss = offloaded.callback_metrics["train_loss"].item()
    assert loss == pytest.approx(plain.callback_metrics["train_loss"].item(), rel=1e-4)


def test_cuda_fp8_recipe_needs_ada_or_newer():
    """``fp8-mixed`` on CUDA runs torchao's real float8 matmuls from compute capability 8.9, and refuses older GPUs
    naming theirs (emulation is for CPU and tests)."""
    pytest.importorskip("torchao")
    from lightning_mgpu.precision import convert_to_float8

    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(RuntimeError, match=r"compute capability >= 8\.9"):
            convert_to_float8(module, emulate=False, device_type="cuda")
        return
    assert convert_to_float8(module, emulate=False, device_type="cuda") == 2
    with torch.autocast("cuda", dtype=torch.bfloat16):
        module(torch.randn(32, 64, device="cuda")).float().sum().backward()


def test_cuda_random_state_is_replayed_for_experts():
    """Expert parallelism replays the MoE block's forward with the random state of its first pass, CUDA's too."""
    from lightning_mgpu.parallel.experts.sharding import _rng_state, _set_rng_state

    state = _rng_state()
    first = torch.rand(4, device="cuda")
    _set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_cuda_planner_reads_the_gpu():
    """``"auto"`` sizes on CUDA plan for this GPU: its preset (by name) and its real memory."""
    from lightning_mgpu.planner.auto import local_cluster

    cluster = local_cluster(world_size=1, devices_per_node=1, accelerator="cuda")
    assert cluster.memory_gb == pytest.approx(torch.cuda.get_device_properties(0).total_memory / 1e9, rel=1e-6)


def test_cuda_monitor_clock_and_measured_peak():
    """The monitor's CUDA clock (events on the stream) and the measured peak of an unknown GPU."""
    from lightning_mgpu.monitor.measures import _measured_matmul_flops
    from lightning_mgpu.monitor.timing import Clock

    clock = Clock(torch.device("cuda"))
    assert clock.cuda
    start = clock.mark()
    torch.randn(2048, 2048, device="cuda") @ torch.randn(2048, 2048, device="cuda")
    end = clock.mark()
    clock.synchronize()
    assert clock.seconds(start, end) > 0
    assert _measured_matmul_flops(torch.device("cuda"), torch.bfloat16) > 1e12


def test_cuda_pretrained_weights_load_onto_the_gpu(tmp_path):
    """``pretrained=`` reads each safetensors slice into a CPU tensor and copies it to the GPU parameter (only
    contiguous CPU targets are read in place): the weights on the GPU equal ``from_pretrained``'s."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.modules import RandomTokenDataModule
    from tests.helpers.pretrained import FineTune, save_checkpoint

    path = save_checkpoint("llama", tmp_path)
    loaded: dict[str, torch.Tensor] = {}

    class Loaded(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            loaded.update({k: v.detach().cpu() for k, v in pl_module.model.state_dict().items()})

    strategy = HybridStrategy(pretrained=str(path))
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Loaded()])  # fmt: skip
    trainer.fit(FineTune(str(path)), RandomTokenDataModule(vocab_size=128, seq_len=16, batch_size=2))
    expected = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_cuda_fsdp2_keeps_its_own_collectives_on_a_cuda_mesh():
    """The gloo reduce-scatter and all-gather (``parallel/data/gloo_comms.py``) go to CPU meshes only: a unit on a
    CUDA mesh keeps FSDP2's NCCL collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_mgpu.parallel.data.gloo_comms import use_gloo_comms
    from tests.helpers.distributed import one_rank_group

    with one_rank_group("cuda"):
        unit = fully_shard(torch.nn.Linear(8, 8).cuda(), mesh=init_device_mesh("cuda", (1,)))
        calls = []
        unit.set_custom_reduce_scatter = lambda comm: calls.append(comm)  # type: ignore[method-assign]
        unit.set_custom_all_gather = lambda comm: calls.append(comm)  # type: ignore[method-assign]
        use_gloo_comms(unit)
        assert calls == []


def test_cuda_deepspeed_backend_trains():
    """``zero_backend="deepspeed"``: DeepSpeed's own CUDA accelerator and NCCL group, like the torch backend."""
    pytest.importorskip("deepspeed")
    theirs = _fit("bf16-mixed", HybridStrategy(zero_backend="deepspeed", zero_stage=2)).callback_metrics
    ours = _fit("bf16-mixed", HybridStrategy(zero_stage=2)).callback_metrics
    assert theirs["train_loss"].item() == pytest.approx(ours["train_loss"].item(), rel=2e-2)
