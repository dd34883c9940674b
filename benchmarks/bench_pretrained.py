"""Benchmark loading pretrained weights: peak host memory per rank and load time, the small way and the scalable way.

A Llama of ``--hidden``/``--layers`` (default ~0.5B parameters, fp32) is saved as sharded Hugging Face safetensors
(``save_pretrained``), then fine-tuned for one step on ``--devices`` forked gloo processes under each layout, twice:

==============  ================================================================================================
path            how the module gets its weights
==============  ================================================================================================
``__init__``    ``AutoModelForCausalLM.from_pretrained(dir)`` in the LightningModule's ``__init__`` (every rank
                holds the whole model before it is sharded)
``scalable``    the model built from its config in ``configure_model`` and ``HybridStrategy(pretrained=dir)``:
                parameters on the meta device, parallelized, then each rank reads only its slices
==============  ================================================================================================

Measured per rank: the process's resident memory before the module is built (the baseline), its high-water mark
from there until training starts (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), the parameter bytes the
rank holds once parallelized (its share) and the largest tensor; the bound the scalable path is held to is
``1.3 x share + largest tensor + baseline``. Load time: the scalable path's read of its slices (``load_weights``,
DCP's planning included) beside a plain ``safetensors`` read of the same slices into new memory (``safe_open`` +
``get_slice`` + ``clone``, every tensor kept) by a fresh process each rank starts right after, so that both write
memory never touched before (the page faults are most of a read from the page cache here).

Run ``python -m benchmarks.bench_pretrained --help`` (from the repository root) for the flags.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.report import MB
from benchmarks.run import quiet_worker, run_or_report

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2xpp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "dp4-zero3": {"zero_stage": 3},
}


def save_llama(directory: Path, hidden: int, layers: int, vocab: int) -> tuple[Path, int]:
    """A Llama with random weights saved as sharded safetensors; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(2, hidden // 256),
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        count = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    if not (directory / "config.json").is_file():
        LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="500MB")
    return directory, count


def job(path: str, layout: str, scalable: bool, verbose: bool) -> dict[str, Any]:
    import torch

    from lightning_mgpu.checkpoint import pretrained
    from lightning_mgpu.strategy import weights
    from tests.helpers.pretrained import setup_memory

    quiet_worker(verbose)
    torch.manual_seed(0)
    reads: list[tuple[str, str, tuple[slice, ...]]] = []
    timed: dict[str, float] = {}
    original_load = weights.load_weights

    def timed_load(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        original_load(*args, **kwargs)
        timed["load_s"] = time.perf_counter() - start

    class RecordingReader(pretrained.HuggingFaceReader):  # the slices DCP asks for, to read them plainly after
        def read_slice(self, file: str, name: str, slices: tuple[slice, ...], into: Any = None) -> torch.Tensor:
            reads.append((file, name, slices))
            return super().read_slice(file, name, slices, into)

    weights.load_weights = timed_load
    pretrained.HuggingFaceReader = RecordingReader  # type: ignore[misc]
    measured = setup_memory(path, LAYOUTS[layout], scalable)
    plain_s = _plain_read(reads) if reads else None
    return {**measured, **timed, "plain_s": plain_s}


# The plain read of the same slices, in a fresh process: its tensors land in new memory, as the load's do (read in
# the rank after training, the copies would reuse memory the step freed, already faulted in: up to 3x faster).
_PLAIN_READ = """
import json, sys, time
import torch
from safetensors import safe_open
reads = json.loads(sys.stdin.read())
kept = []
start = time.perf_counter()
for file in sorted({file for file, _, _ in reads}):
    with safe_open(file, framework="pt") as handle:
        for _, name, box in (r for r in reads if r[0] == file):
            kept.append(handle.get_slice(name)[tuple(slice(a, b) for a, b in box)].clone())
print(time.perf_counter() - start)
"""


def _plain_read(reads: list[tuple[str, str, tuple[slice, ...]]]) -> float:
    """Seconds a fresh process takes to read ``reads`` with ``safetensors`` (``safe_open`` + ``get_slice`` +
    ``clone``, every tensor kept), its start-up not counted."""
    import json
    import subprocess
    import sys

    boxes = [(file, name, [(s.start, s.stop) for s in slices]) for file, name, slices in reads]
    result = subprocess.run(
        [sys.executable, "-c", _PLAIN_READ], input=json.dumps(boxes), capture_output=True, text=True, check=True
    )
    return float(result.stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {sorted(LAYOUTS)}")
    parser.add_argument("--paths", default="__init__,scalable", help="comma-separated, of __init__ and scalable")
    parser.add_argument("--dir", help="where to save the model (default: a temporary directory)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-pretrained-"))
    path, count = save_llama(root / "llama", args.hidden, args.layers, args.vocab)
    print(f"Llama of {count / 1e9:.2f}B parameters ({count * 4 / MB:.0f} MB fp32) saved in {path}", flush=True)
    rows = []
    for layout in args.layouts.split(","):
        for scalable in [path == "scalable" for path in args.paths.split(",")]:
            name = f"{layout} {'scalable' if scalable else '__init__'}"
            outputs = run_or_report(
                name, partial(job), args.devices, str(path), layout, scalable, args.verbose, timeout=1800
            )
            if outputs is None:
                if not scalable:
                    print(
                        f"{name:22s} (exit code -9: the kernel killed the ranks for memory, each holding the whole"
                        " model on the host at once)",
                        flush=True,
                    )
                continue
            for rank, out in enumerate(outputs):
                peak = (out["peak_kib"] - out["baseline_kib"]) * 1024
                bound = 1.3 * out["held_bytes"] + out["largest_bytes"]
                rows.append((name, rank, out, peak, bound))
                load = f"{out['load_s']:.2f} s vs plain {out['plain_s']:.2f} s" if out.get("plain_s") else ""
                held = out["held_bytes"] / MB
                print(
                    f"{name:22s} rank {rank}: peak above baseline {peak / MB:8.0f} MB, share {held:6.0f} MB,"
                    f" bound {bound / MB:6.0f} MB ({peak / bound:4.2f}x)  {load}",
                    flush=True,
                )
            if all(out.get("plain_s") for out in outputs):
                # The job starts training when its slowest rank has its weights: the ranks' slowest against theirs.
                load_s, plain_s = max(o["load_s"] for o in outputs), max(o["plain_s"] for o in outputs)
                print(
                    f"{name:22s} the job: load {load_s:.2f} s (slowest rank) vs plain read {plain_s:.2f} s"
                    f" (slowest rank): {load_s / plain_s:.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
