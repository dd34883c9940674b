"""Check the GPU paths on one CUDA device in a few minutes, and write what was measured (JSON + Markdown).

Run it first whenever a GPU is lent (`python -m benchmarks.gpu_check`, from the root of a checkout with the README's
install and the CUDA torch wheel). Parts, each reported as measured, failed (with the error) or "no CUDA device":

a. HybridStrategy at devices=1 against Lightning's own single-device training of the same ~1B Llama (bf16-mixed):
   tokens/s ratio and peak memory.
b. MFU against the GPU's dense bf16 peak (``lightning_mgpu.gpus``), beside the planner's prediction for that run,
   and the factor by which the planner's GEMM efficiency would have to change to match (printed as a patch).
c. ``compile=True`` on/off and ``fp8-mixed`` (torchao Float8Linear) on/off: tokens/s speedups.
d. Activation checkpointing: peak memory with and without it.
e. The suite's ``@pytest.mark.cuda`` tests (``tests/test_cuda.py``).
f. Context-parallel attention's block kernel (``parallel/context/kernels.py``) on one GPU: the ring (a ring of one
   rank: two chunks, three causal blocks merged by their log-sum-exp) and the all-to-all's whole-sequence block
   against ``F.scaled_dot_product_attention`` on the full sequence (bf16, grouped-query heads; output and
   gradients within bf16 tolerance), for the kernel chosen and for each of flash, memory-efficient and cuDNN
   where the GPU has it; the peak memory of one block against SDPA's on the same block (target: within 2x).
g. The optimizer step on CUDA DTensor shards: ``ShardLocalStep`` (``parallel/local_step.py``) against the DTensor
   path, AdamW: the same parameters, and the step-time ratio.
h. With 2 GPUs or more: dp 2 ZeRO-3, tp 2, pp 2 and cp 2 against one GPU (demo GPT, bf16-mixed; every step's loss
   within bf16 tolerance) and the NCCL bytes each rank sends per step against the analytic minimum
   (``benchmarks/gpu_layouts.py``, each layout in fresh processes under torchrun).

The report (``--out``, default ``gpu_check/``: ``gpu_check.json`` and ``gpu_check.md``) names the device, driver,
torch, CUDA, cuDNN and NCCL versions. The whole check is meant to take under 8 minutes on one H100/H200 (each part's
seconds are reported); ``--parts`` runs some of them. On a machine without CUDA every part says so and the script
exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

NO_CUDA = "no CUDA device"
REPO = Path(__file__).resolve().parents[1]
# ~1.1B parameters: Llama shapes (TinyLlama's), sequences of 2048 tokens.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}  # fmt: skip


def _module(shapes: dict[str, Any]) -> Any:
    from examples.rehearse.llama import LlamaLM

    return LlamaLM(**shapes)


class _Tokens:
    """Random token batches, made on the GPU by the module's own step: no data loading in the measurement."""

    @staticmethod
    def loader(batch: int, seq: int, steps: int) -> Any:
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        tokens = torch.randint(0, LLAMA_1B["vocab_size"], (batch * steps, seq))
        return DataLoader(TensorDataset(tokens, tokens), batch_size=batch)


class _Clock:
    """Tokens per second over the steps after ``warmup`` (CUDA-synchronized), and the peak memory."""

    def __init__(self, tokens_per_step: int, warmup: int) -> None:
        self.tokens_per_step, self.warmup = tokens_per_step, warmup
        self.times: list[float] = []

    def callback(self) -> Any:
        import lightning as L
        import torch

        clock = self

        class Timer(L.Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                torch.cuda.synchronize()
                clock.times.append(time.perf_counter())

        return Timer()

    def tokens_per_s(self) -> float:
        measured = self.times[self.warmup :]
        return self.tokens_per_step * (len(measured) - 1) / (measured[-1] - measured[0])


def _run(strategy: Any, precision: str, args: argparse.Namespace, shapes: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch

    torch.cuda.reset_peak_memory_stats()
    clock = _Clock(args.batch * args.seq, args.warmup)
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock.callback()],
        precision=precision,  # type: ignore[arg-type]  # Lightning's Literal leaves out HybridStrategy's "fp8-mixed"
    )  # fmt: skip
    trainer.fit(_module(shapes), _Tokens.loader(args.batch, args.seq, args.steps))
    result = {"tokens_per_s": clock.tokens_per_s(), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del trainer
    torch.cuda.empty_cache()
    return result


def part_a(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_mgpu import HybridStrategy

    ours = _run(HybridStrategy(), "bf16-mixed", args, LLAMA_1B)
    lightning = _run("auto", "bf16-mixed", args, LLAMA_1B)
    return {"hybrid": ours, "lightning": lightning, "ratio": ours["tokens_per_s"] / lightning["tokens_per_s"],
            "target": ">= 0.97"}  # fmt: skip


def part_b(args: argparse.Namespace, a: dict[str, Any]) -> dict[str, Any]:
    import torch

    from examples.rehearse.llama import LlamaLM
    from lightning_mgpu.gpus import gpu_named
    from lightning_mgpu.planner import Efficiency, Layout, Microbatching, Training, estimate, preset
    from lightning_mgpu.planner.model_spec import build_on_meta, spec_from_module

    name = torch.cuda.get_device_name()
    gpu = gpu_named(name)
    model = spec_from_module(build_on_meta(LlamaLM, LLAMA_1B), seq_len=args.seq)
    flops = (
        6 * sum(p.numel() for p in build_on_meta(LlamaLM, LLAMA_1B).parameters())
        + 12 * model.layers * model.hidden * args.seq
    )
    measured = a["hybrid"]["tokens_per_s"] * flops
    result: dict[str, Any] = {"device": name, "model_flops_per_token": flops}
    if gpu is None:
        return {**result, "mfu": None, "note": f"{name!r} is not in lightning_mgpu/gpus.py: add its peaks"}
    peak = gpu.bf16_tflops * 1e12
    result["mfu"] = measured / peak
    result["target"] = ">= 0.40"
    try:
        cluster = preset(gpu.preset, gpus=1)
        if cluster is not None:
            layout = Layout(microbatching=Microbatching(size=args.batch))  # one GPU, one batch per step
            predicted = estimate(model, cluster, Training(args.batch, "bf16-mixed"), layout, Efficiency())
            result["planner_tokens_per_s"] = predicted.tokens_per_s
            result["planner_mfu"] = predicted.mfu
            result["gemm_efficiency_patch"] = (
                f"planner/cluster.py Efficiency.gemm x {a['hybrid']['tokens_per_s'] / predicted.tokens_per_s:.3f}"
            )
    except Exception as error:  # noqa: BLE001 - the measurement stands without the prediction
        result["planner_error"] = f"{type(error).__name__}: {error}"
    return result


def part_c(args: argparse.Namespace, a: dict[str, Any]) -> dict[str, Any]:
    from lightning_mgpu import HybridStrategy

    compiled = _run(HybridStrategy(compile=True), "bf16-mixed", args, LLAMA_1B)
    result: dict[str, Any] = {"compile_speedup": compiled["tokens_per_s"] / a["hybrid"]["tokens_per_s"],
                              "compile_target": ">= 1.1"}  # fmt: skip
    try:
        fp8 = _run(HybridStrategy(compile=True), "fp8-mixed", args, LLAMA_1B)
        result["fp8_speedup_over_compiled_bf16"] = fp8["tokens_per_s"] / compiled["tokens_per_s"]
        result["fp8_target"] = ">= 1.2"
    except Exception as error:  # noqa: BLE001 - reported, the other numbers stand
        result["fp8_error"] = f"{type(error).__name__}: {error}"
    return result


def part_d(args: argparse.Namespace, a: dict[str, Any]) -> dict[str, Any]:
    from lightning_mgpu import HybridStrategy

    checkpointed = _run(HybridStrategy(activation_checkpointing=True), "bf16-mixed", args, LLAMA_1B)
    return {"peak_gib_without": a["hybrid"]["peak_gib"], "peak_gib_with": checkpointed["peak_gib"],
            "step_cost": a["hybrid"]["tokens_per_s"] / checkpointed["tokens_per_s"]}  # fmt: skip


def part_e(args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "-m",
        "cuda",
        "tests/test_cuda.py",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    return {"exit_code": done.returncode, "summary": done.stdout.strip().splitlines()[-1:] or [done.stderr[-500:]]}


# ----------------------------------------------------------------------------------- f: context-parallel kernels
BF16_RTOL = 2e-2  # relative error (norm of the difference over the reference's) within bf16 rounding
_KERNEL_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def _relative_errors(mine: Any, reference: Any) -> dict[str, float]:
    """``{out, dq, dk, dv}``: the norm of each difference over the reference's norm."""
    return {
        name: float((a.float() - b.float()).norm() / b.float().norm())
        for name, a, b in zip(("out", "dq", "dk", "dv"), mine, reference)
    }


def _with_gradients(attention: Any, q: Any, k: Any, v: Any, grad: Any) -> list[Any]:
    """The output of ``attention(q, k, v)`` and the gradients ``grad`` gives q, k and v through it."""
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _peak_bytes(run: Any, device: str) -> int | None:
    """The most CUDA memory ``run()`` allocated above what was allocated before it (None off CUDA)."""
    import torch

    if device != "cuda":
        run()
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def part_f(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_mgpu.parallel.context import ring_attention
    from lightning_mgpu.parallel.context.attention import _attention, _attention_backward, block_attention
    from lightning_mgpu.parallel.context.kernels import kernel_for
    from tests.helpers.distributed import one_rank_group

    heads, kv_heads, head_dim, seq = 32, 8, 128, args.cp_seq
    g = torch.Generator(device=args.device).manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, h, seq, head_dim, device=args.device, dtype=torch.bfloat16, generator=g)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    hq, hk, hv, hgrad = (t[:, :, : seq // 2].contiguous() for t in (q, k, v, grad))  # one block of the ring

    def sdpa(query: Any, key: Any, value: Any) -> Any:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)

    def ours_on_a_block() -> None:
        out, lse = _attention(hq, hk, hv, True, None)
        _attention_backward(hgrad, hq, hk, hv, out, lse, True, None)

    def ring(query: Any, key: Any, value: Any) -> Any:
        return ring_attention(query, key, value, True, None, dist.group.WORLD)  # type: ignore[arg-type]  # set by now

    def whole(query: Any, key: Any, value: Any) -> Any:  # the all-to-all's attention on the gathered sequence
        return block_attention(query, key, value, True)

    reference = _with_gradients(sdpa, q, k, v, grad)  # torch's own choice of kernel, on the whole sequence
    sdpa_peak = _peak_bytes(lambda: _with_gradients(sdpa, hq, hk, hv, hgrad), args.device)  # and on one block
    shape = f"(1, {heads} query / {kv_heads} key-value heads, {seq} tokens, {head_dim}) bf16"
    result: dict[str, Any] = {"shape": shape, "math_block_scores_gib": heads * (seq // 2) ** 2 * 4 / 2**30}

    def measured(name: str) -> dict[str, Any]:
        """``name``: ``chosen`` (the kernels torch allows by default) or the one kernel SDPA is restricted to; the
        memory against SDPA's as torch chooses its kernel."""
        backends = [getattr(SDPBackend, _KERNEL_BACKENDS[name])] if name in _KERNEL_BACKENDS else None
        with sdpa_kernel(backends) if backends else nullcontext():
            choice = kernel_for(hq, hk, hv, True)
            if backends and choice.kernel != name:
                return {"skipped": f"not this GPU's: {choice.reason}"}
            rings, wholes = (_with_gradients(attention, q, k, v, grad) for attention in (ring, whole))
            peak = _peak_bytes(ours_on_a_block, args.device)
        errors = {"ring": _relative_errors(rings, reference), "block": _relative_errors(wholes, reference)}
        worst = max(e for mode in errors.values() for e in mode.values())
        return {"kernel": choice.kernel, "reason": choice.reason, "relative_errors": errors,
                "within_bf16": worst <= BF16_RTOL, **_memory(peak, sdpa_peak)}  # fmt: skip

    with one_rank_group(args.device):
        for name in ("chosen", *_KERNEL_BACKENDS):
            try:
                result[name] = measured(name)
            except Exception as error:  # noqa: BLE001 - each kernel reports, none stops the others
                result[name] = {"failed": f"{type(error).__name__}: {error}"}
    return result


def _memory(peak: int | None, sdpa_peak: int | None) -> dict[str, Any]:
    if peak is None or sdpa_peak is None:
        return {"memory": "not measured off CUDA"}
    return {"block_peak_gib": peak / 2**30, "sdpa_block_peak_gib": sdpa_peak / 2**30,
            "memory_ratio": peak / max(sdpa_peak, 1), "memory_target": "<= 2"}  # fmt: skip


# ------------------------------------------------------------------------------ g: the optimizer step on shards
def part_g(args: argparse.Namespace) -> dict[str, Any]:
    import statistics

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_mgpu.parallel.local_step import ShardLocalStep, steps_on_shards
    from tests.helpers.distributed import one_rank_group

    rows = 4096 if args.device == "cuda" else 64  # ~100M parameters on a GPU: a block stack's matrices and vectors
    shapes = [(rows, 1024)] * 24 + [(1024,)] * 24

    def tensors(seed: int) -> list[Any]:
        g = torch.Generator(device=args.device).manual_seed(seed)
        return [torch.randn(shape, device=args.device, generator=g) for shape in shapes]

    with one_rank_group(args.device):
        mesh = init_device_mesh(args.device, (1,))
        runs = {}
        for path in ("dtensor", "shard_local"):
            params = [nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in tensors(0)]
            optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
            wrapper = ShardLocalStep(optimizer) if path == "shard_local" else None
            if wrapper is not None and not steps_on_shards(optimizer):
                raise RuntimeError("ShardLocalStep has no work on the DTensor AdamW: the check would compare nothing")
            times = []
            for step in range(args.g_steps):
                for param, grad in zip(params, tensors(step + 1)):
                    param.grad = distribute_tensor(grad, mesh, [Shard(0)])
                _synchronize(args.device)
                start = time.perf_counter()
                optimizer.step()
                _synchronize(args.device)
                times.append(time.perf_counter() - start)
            if wrapper is not None:
                wrapper.remove()
            runs[path] = ([cast(Any, p).detach().full_tensor() for p in params], statistics.median(times[2:]))
    difference = max(float((a - b).abs().max()) for a, b in zip(runs["dtensor"][0], runs["shard_local"][0]))
    dtensor_s, local_s = runs["dtensor"][1], runs["shard_local"][1]
    return {"parameters": sum(math.prod(s) for s in shapes), "steps": args.g_steps,
            "max_abs_difference": difference, "same_result": difference <= 1e-6,
            "dtensor_ms": dtensor_s * 1e3, "shard_local_ms": local_s * 1e3, "speedup": dtensor_s / local_s,
            "target": "same result (<= 1e-6); speedup >= 1"}  # fmt: skip


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------- h: layouts on 2+ GPUs
def part_h(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.gpu_layouts import LAYOUTS

    count = torch.cuda.device_count()
    if count < 2:
        return {"skipped": f"needs 2 GPUs or more; {count} here"}
    folder = Path(args.out).resolve() / "layouts"
    folder.mkdir(parents=True, exist_ok=True)
    ranks = {}
    result: dict[str, Any] = {}
    for layout, (processes, _) in LAYOUTS.items():
        try:
            ranks[layout] = _launch_layout(layout, processes, folder)
        except Exception as error:  # noqa: BLE001 - every layout reports, none stops the others
            result[layout] = {"failed": f"{type(error).__name__}: {error}"}
    if "one" not in ranks:
        return {**result, "skipped": "the one-GPU reference failed: nothing to compare with"}
    reference = ranks["one"][0]["losses"]
    for layout, outputs in ranks.items():
        if layout == "one":
            continue
        losses = outputs[0]["losses"]
        difference = max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) if losses else float("nan")
        sent = max(o["bytes"] for o in outputs)
        analytic = outputs[0]["analytic_bytes"]
        result[layout] = {"loss_relative_difference": difference, "losses_within_bf16": difference <= BF16_RTOL,
                          "bytes_per_step": sent, "analytic_bytes": analytic, "formula": outputs[0]["analytic_formula"],
                          "bytes_ratio": sent / analytic if analytic else None, "by_kind": outputs[0]["by_kind"],
                          "unknown_work_items": outputs[0]["unknown_work_items"]}  # fmt: skip
    return result


def _launch_layout(layout: str, processes: int, folder: Path) -> list[dict[str, Any]]:
    """``benchmarks.gpu_layouts`` for ``layout`` in fresh processes (torchrun for two or more); each rank's result."""
    prefix = folder / layout
    worker = ["-m", "benchmarks.gpu_layouts", "--layout", layout, "--out", str(prefix)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    done = subprocess.run([sys.executable, *launcher, *worker], capture_output=True, text=True, cwd=REPO,
                          timeout=600, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"exit code {done.returncode}: {done.stderr[-1500:]}")
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(processes)]


# ------------------------------------------------------------------------------------------------ the report
PARTS = "abcdefgh"


def environment() -> dict[str, Any]:
    """What the numbers were measured on: device, driver, torch, CUDA, cuDNN and NCCL versions."""
    import torch

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if not torch.cuda.is_available():
        return {**found, "device": NO_CUDA}
    major, minor = torch.cuda.get_device_capability()
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {**found, "device": torch.cuda.get_device_name(), "devices": torch.cuda.device_count(),
            "capability": f"sm_{major}{minor}", "driver": _driver_version(), "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}  # fmt: skip


def _driver_version() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({type(error).__name__})"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--parts", default=PARTS, help=f"the parts to run, e.g. 'fgh' (default: {PARTS})")
    parser.add_argument("--steps", type=int, default=30, help="training steps per measured run (a-d)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s (a-d)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (a-d)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (a-d)")
    parser.add_argument("--cp-seq", type=int, default=16384, help="tokens of the attention check's sequence (f)")
    parser.add_argument("--g-steps", type=int, default=12, help="optimizer steps per path (g)")
    dry_run = "run parts f and g on CPU tensors: checks this script's code without a GPU (no GPU numbers)"
    parser.add_argument("--cpu-dry-run", action="store_true", help=dry_run)
    args = parser.parse_args(argv)
    if not args.parts or set(args.parts) - set(PARTS):
        parser.error(f"--parts takes letters of {PARTS!r}, not {args.parts!r}")
    import torch

    args.device = "cpu" if args.cpu_dry_run else "cuda"
    started = time.perf_counter()
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": environment()}
    parts = [p for p in PARTS if p in args.parts and (p in "fg" or not args.cpu_dry_run)]
    if args.device == "cuda" and not torch.cuda.is_available():
        report.update(dict.fromkeys(parts, NO_CUDA))
    else:
        a = _part("a", report, lambda: part_a(args)) if "a" in parts else None
        for part, run in (("b", part_b), ("c", part_c), ("d", part_d)):
            if part in parts:
                _part(part, report, lambda run=run: run(args, a) if a else {"skipped": "part a did not run"})
        for part, alone in (("e", part_e), ("f", part_f), ("g", part_g), ("h", part_h)):
            if part in parts:
                _part(part, report, lambda alone=alone: alone(args))
    report["seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    markdown = "\n".join(["# gpu_check", "", *_markdown(report)])
    (out / "gpu_check.md").write_text(markdown + "\n")
    print(markdown)
    return 0


def _markdown(value: dict[str, Any], depth: int = 0) -> list[str]:
    """Nested bullet lists, numbers to 4 significant digits."""
    lines = []
    for key, item in value.items():
        head = f"{'  ' * depth}- **{key}**:"
        if isinstance(item, dict):
            lines += [head, *_markdown(item, depth + 1)]
        else:
            lines.append(f"{head} {f'{item:.4g}' if isinstance(item, float) else item}")
    return lines


def _part(name: str, report: dict[str, Any], run: Any) -> Any:
    start = time.perf_counter()
    try:
        result = run()
    except Exception as error:  # noqa: BLE001 - every part reports, none stops the others
        report[name] = {"failed": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
        return None
    report[name] = {**result, "seconds": round(time.perf_counter() - start, 1)}
    return result


if __name__ == "__main__":
    sys.exit(main())
