"""One layout of the GPU check's part (h) in this job's processes: its losses and the bytes each rank sends.

``python -m benchmarks.gpu_check`` starts it once per layout, the two-process ones under torchrun
(``python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.gpu_layouts --layout tp2 ...``) and
the one-GPU reference as a plain process, each fresh (a process that has touched CUDA cannot fork ranks). Every
layout fits the demo GPT in bf16-mixed on the same global batches; each rank writes ``<out>.rank<r>.json``: the loss
of every step as rank 0's loggers see it, and the bytes it sent in one profiled step after the warm-up.

Bytes are read from the backend's work items in ``torch.profiler`` (``nccl:*`` on GPUs, ``gloo:*`` on CPU: their
tensors' shapes and dtypes), as ring algorithms send them over a group of ``w`` ranks (every group here has two):
all-reduce ``2(w-1)/w B``, reduce-scatter, all-to-all and broadcast ``(w-1)/w B`` of the whole tensor, all-gather
``(w-1)`` times this rank's shard, a send its tensor. The analytic minimum per layout (:func:`analytic_bytes`):

=============  ========================================================================================================
``dp2-zero3``  parameters all-gathered in forward, the blocks' again in backward, gradients reduce-scattered (fp32,
               ``bench_peers.analytic_comm``)
``tp2``        Megatron-LM: per block 2 all-reduces of the ``b x s x h`` activation in forward (bf16: row-parallel
               outputs under autocast) and 2 of its gradient in backward (fp32: the residual stream's), and the fused
               q|k|v bias gradient all-gathered (``bench_tensor.analytic_comm``'s terms)
``pp2``        the stage boundary's ``b x s x h`` activation (fp32: the residual stream) forward, its gradient back
``cp2``        per layer the key/value block (bf16) sent once forward and once more backward, its gradient (fp32,
               accumulated over the hops as torch's ``context_parallel`` accumulates it) twice, home included; the
               parameters' gradients all-reduced over the cp pair (fp32)
=============  ========================================================================================================

Measured on gloo CPU processes (``--accelerator cpu``, the defaults below): every layout's bytes equal its analytic
minimum but for the few bytes of the logged loss (dp2-zero3 77.2 MB, tp2 50.3 MB, pp2 4.2 MB, cp2 102.3 MB per rank
per step), and every step's loss within 1e-4 of one process.

``--accelerator cpu`` runs the same on gloo processes (a dry run of the check's code without a GPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.run import SEED

# name -> (processes, HybridStrategy arguments)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "one": (1, {}),
    "dp2-zero3": (2, {"zero_stage": 3}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2, "num_microbatches": 4}),
    "cp2": (2, {"context_parallel_size": 2}),
}
MODEL: dict[str, Any] = {"block_size": 256, "n_layer": 4, "n_head": 8, "n_embd": 512, "dropout": 0.0, "seed": SEED}
GLOBAL_BATCH = 8
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1}
_KINDS = (  # substring of the work item's name -> kind; "reduce_scatter" before "all_reduce" cannot clash
    ("reduce_scatter", "RS"), ("reducescatter", "RS"), ("all_reduce", "AR"), ("allreduce", "AR"),
    ("all_gather", "AG"), ("allgather", "AG"), ("all_to_all", "A2A"), ("alltoall", "A2A"), ("broadcast", "BC"),
    ("send", "SEND"), ("recv", "RECV"), ("barrier", "BAR"),
)  # fmt: skip


def data_parallel_size(layout: str) -> int:
    processes, options = LAYOUTS[layout]
    others = [options.get(k, 1) for k in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")]
    return processes // (others[0] * others[1] * others[2])


def analytic_bytes(layout: str, activation_bytes: int = 2) -> tuple[float, str]:
    """The fewest bytes a rank sends per step in ``layout`` (see the module docstring), and the formula; gradients
    of activations and parameters in fp32, activations in ``activation_bytes`` (bf16 under bf16-mixed)."""
    from benchmarks.bench_peers import analytic_comm

    total, blocks = _parameters()
    b, s, h, layers = GLOBAL_BATCH // data_parallel_size(layout), MODEL["block_size"], MODEL["n_embd"], MODEL["n_layer"]
    tokens, a = b * s * h, activation_bytes
    if layout == "one":
        return 0.0, "one process"
    if layout == "dp2-zero3":
        return analytic_comm("zero3", 2, total, total - blocks)
    if layout == "tp2":  # 2(w-1)/w = 1 and (w-1) x the shard = h/2 at w = 2
        return layers * (tokens * (2 * a + 2 * 4) + 3 * h // 2 * 4), "L (b s h (2 A + 2 x 4) + 3h/2 x 4)"
    if layout == "pp2":
        return tokens * 4.0, "b s h x 4"
    return layers * tokens * (2 * a + 2 * 4) + 4.0 * total, "L b s h (2 A + 2 x 4) + 4 N"  # cp2: K+V = b s h


def _parameters() -> tuple[int, int]:
    """The demo GPT's parameters: all, and those inside its blocks."""
    import torch

    from lightning_mgpu.demo import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(**{k: v for k, v in MODEL.items() if k != "seed"}))
    return sum(p.numel() for p in gpt.parameters()), sum(p.numel() for p in gpt.transformer.h.parameters())


def sent_bytes(profiler: Any, world: int, batched_sends: float = 0.0) -> dict[str, Any]:
    """Bytes this rank sent by kind in a ``torch.profiler`` run (its backend work items), and the work items of no
    known kind (listed, not counted). NCCL runs ``batch_isend_irecv`` as one coalesced work item without its tensors:
    where one was seen, ``batched_sends`` (the bytes of the batches' sends, counted as they were issued) stands in
    for it as ``SEND_BATCHED``; gloo runs each send as a work item of its own."""
    f = (world - 1) / world
    factor = {"AR": 2 * f, "RS": f, "A2A": f, "BC": f, "AG": world - 1.0, "SEND": 1.0, "RECV": 0.0, "BAR": 0.0}
    by_kind: dict[str, float] = {}
    unknown: set[str] = set()
    for event in profiler.profiler.kineto_results.events():
        name = event.name()
        if not name.startswith(("nccl:", "gloo:")):
            continue
        kind = next((k for key, k in _KINDS if key in name), None)
        if kind is None:
            unknown.add(name)
            continue
        size = sum(
            _numel(shape) * _DTYPE_BYTES.get(dtype, 4)
            for shape, dtype in zip(event.shapes(), event.dtypes())
            if shape and dtype != "TensorList"
        )
        by_kind[kind] = by_kind.get(kind, 0.0) + factor[kind] * size
    if any("coalesced" in name for name in unknown):
        by_kind["SEND_BATCHED"] = batched_sends
    return {"bytes": sum(by_kind.values()), "by_kind": by_kind, "unknown_work_items": sorted(unknown),
            "batched_sends": batched_sends}  # fmt: skip


class BatchedSends:
    """Within: the bytes of the sends every ``torch.distributed.batch_isend_irecv`` call issues (ring attention's
    and the pipeline schedule's mixed batches), counted as they are issued."""

    def __init__(self) -> None:
        self.bytes = 0.0

    def __enter__(self) -> BatchedSends:
        import torch.distributed as dist

        self._original = dist.batch_isend_irecv

        def counted(ops: list[Any]) -> Any:
            sends = (op.tensor for op in ops if op.op in (dist.isend, dist.send))
            self.bytes += sum(t.numel() * t.element_size() for t in sends)
            return self._original(ops)

        dist.batch_isend_irecv = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.batch_isend_irecv = self._original


def _numel(shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _callbacks(profiled_step: int, world: int) -> tuple[Any, Any]:
    import lightning as L
    from torch.profiler import ProfilerActivity, profile

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if "train_loss" in trainer.callback_metrics:
                self.losses.append(float(trainer.callback_metrics["train_loss"]))

    class Traffic(L.Callback):
        """The bytes this rank sends in training batch ``profiled_step``."""

        def __init__(self) -> None:
            self.result: dict[str, Any] = {}
            self._profiler: Any = None
            self._sends = BatchedSends()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == profiled_step:
                self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                self._profiler.__enter__()
                self._sends.__enter__()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if self._profiler is not None:
                self._sends.__exit__()
                self._profiler.__exit__(None, None, None)
                self.result = sent_bytes(self._profiler, world, self._sends.bytes)
                self._profiler = None

    return Losses(), Traffic()


def run(layout: str, accelerator: str, steps: int, out: Path) -> dict[str, Any]:
    """Fit ``layout`` in this process (a rank of it); write and return this rank's result."""
    import lightning as L

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    processes, options = LAYOUTS[layout]
    L.seed_everything(SEED, verbose=False)
    losses, traffic = _callbacks(profiled_step=min(3, steps - 1), world=processes)
    trainer = L.Trainer(
        accelerator=accelerator, devices=processes, strategy=HybridStrategy(**options), precision="bf16-mixed",
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[losses, traffic],
    )  # fmt: skip
    batch = GLOBAL_BATCH // data_parallel_size(layout)
    trainer.fit(GPTLightningModule(**MODEL), TextDataModule(batch_size=batch, block_size=MODEL["block_size"]))
    analytic, formula = analytic_bytes(layout)
    result = {"layout": layout, "rank": trainer.global_rank, "losses": losses.losses, **traffic.result,
              "analytic_bytes": analytic, "analytic_formula": formula}  # fmt: skip
    Path(f"{out}.rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--accelerator", default="cuda", help="cuda (the check), or cpu for a dry run on gloo")
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--out", required=True, help="path prefix of the per-rank JSON files")
    args = parser.parse_args(argv)
    run(args.layout, args.accelerator, args.steps, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
