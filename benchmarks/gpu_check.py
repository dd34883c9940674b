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

On a machine without CUDA every part says so and the script exits 0. ``--help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

NO_CUDA = "no CUDA device"
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
    from lightning_mgpu.planner import Efficiency, Layout, Training, estimate, preset
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
            layout = Layout(microbatch_size=args.batch, num_microbatches=1)
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
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], check=False)
    return {"exit_code": done.returncode, "summary": done.stdout.strip().splitlines()[-1:] or [done.stderr[-500:]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--steps", type=int, default=30, help="training steps per measured run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    args = parser.parse_args(argv)
    import torch

    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__}
    if not torch.cuda.is_available():
        report.update(dict.fromkeys("abcde", NO_CUDA))
    else:
        report["device"] = torch.cuda.get_device_name()
        a = _part("a", report, lambda: part_a(args))
        for part, run in (("b", part_b), ("c", part_c), ("d", part_d)):
            _part(part, report, lambda run=run: run(args, a) if a else {"skipped": "part a failed"})
        _part("e", report, lambda: part_e(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    markdown = "\n".join(["# gpu_check", "", *(f"- **{k}**: {v}" for k, v in report.items())])
    (out / "gpu_check.md").write_text(markdown + "\n")
    print(markdown)
    return 0


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
