"""Benchmark HybridStrategy's ZeRO stages 0-3 against Lightning's own strategies, on one model and one dataset.

One run fits the demo GPT (``lightning_mgpu.demo``) with Lightning's ``Trainer`` under each configuration below,
every configuration in its own set of forked gloo processes (``tests/helpers/distributed.run_distributed``), all
with the same number of processes, model, data, seed and per-rank batch:

=====================  ====================================================================  =================
name                   what                                                                  peer (ratio vs)
=====================  ====================================================================  =================
``ddp``                Lightning ``DDPStrategy``                                             -
``fsdp2``              Lightning ``ModelParallelStrategy(dp=N, tp=1)``, ``fully_shard`` per   -
                       block then the root, applied by hand in ``configure_model`` with
                       FSDP2's defaults (blocks resharded after forward, the root not)
``fsdp2-noreshard``    the same with ``reshard_after_forward=False``                         -
``hybrid-zero0``       ``HybridStrategy(zero_stage=0)`` (FSDP2 ``replicate``)                ``ddp``
``hybrid-zero1``       ``HybridStrategy(zero_stage=1)`` (replicate + optimizer sharding)     ``ddp`` (*)
``hybrid-zero2``       ``HybridStrategy(zero_stage=2)`` (``fully_shard``, no reshard)        ``fsdp2-noreshard``
``hybrid-zero3``       ``HybridStrategy(zero_stage=3)`` (``fully_shard``)                    ``fsdp2``
=====================  ====================================================================  =================

(*) The honest peers of stages 1 and 2 are DeepSpeed ZeRO-1/2. ``deepspeed`` is only used if importable, and even
then not yet: Lightning's ``DeepSpeedStrategy`` refuses CPU, so it would need ``deepspeed.initialize`` by hand,
outside a Trainer. Stage 1 is therefore compared with DDP, which communicates the same gradients.

Measured, per configuration (the notes printed under the table say the same):

- step time: wall time ``on_train_batch_start`` -> ``on_train_batch_end`` (forward, backward, optimizer step),
  per step the slowest rank, median over the steps after ``--warmup``; the process CPU time of the same span
  (less sensitive to other jobs on a shared machine); both split into forward / backward / optimizer phases with
  ``on_before_backward`` and ``on_after_backward``;
- memory per rank right after backward, before the optimizer step (``on_before_optimizer_step`` on optimizer
  step ``--mem-step``): bytes of the parameters as registered (local shards: ``DTensor.to_local()``), of their
  ``.grad`` and of the optimizer's state tensors; plus, for FSDP2-based wrappers, bytes held in unsharded
  (all-gathered) parameter buffers at that moment ("gath") and between forward and backward ("g.fwd");
- collectives of one extra, untimed step, recorded with ``torch.profiler`` on every rank: count per kind, and
  the bytes they put on the wire, to compare with the analytic volume.

Analytic numbers use N parameters, dp data-parallel ranks, fp32 weights and AdamW (4 B param + 4 B grad + 8 B
state per parameter); see ``analytic_bytes_per_param`` and ``analytic_comm`` below.

Run ``python benchmarks/bench_zero.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from tests.helpers.distributed import run_distributed  # noqa: E402

SEED = 1234
# Every benchmark Trainer: no logger, checkpoints, progress bar, summary or validation to time alongside the steps.
QUIET_TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0)
MB = 2**20

# name -> (kind, options, peer)
CONFIGS: dict[str, tuple[str, dict[str, Any], Optional[str]]] = {
    "ddp": ("ddp", {}, None),
    "fsdp2": ("fsdp2", {"reshard_after_forward": None}, None),  # None: FSDP2's default (blocks True, root False)
    "fsdp2-noreshard": ("fsdp2", {"reshard_after_forward": False}, None),
    "hybrid-zero0": ("hybrid", {"zero_stage": 0}, "ddp"),
    "hybrid-zero1": ("hybrid", {"zero_stage": 1}, "ddp"),
    "hybrid-zero2": ("hybrid", {"zero_stage": 2}, "fsdp2-noreshard"),
    "hybrid-zero3": ("hybrid", {"zero_stage": 3}, "fsdp2"),
}
ORDER = ["ddp", "hybrid-zero0", "hybrid-zero1", "fsdp2-noreshard", "hybrid-zero2", "fsdp2", "hybrid-zero3"]


# --------------------------------------------------------------------------------------------------- analytics

def run_or_report(name: str, job: Any, devices: int, *args: Any, timeout: float, verbose: bool) -> Any:
    """Run ``job`` on ``devices`` forked ranks; on failure print one line (all of it with ``verbose``), return None.

    One failing configuration must not hide the others.
    """
    try:
        return run_distributed(job, devices, *args, timeout=timeout)
    except Exception as err:
        print(f"{name}: FAILED: {str(err).strip().splitlines()[-1]}", flush=True)
        if verbose:
            print(err)
        return None

def analytic_bytes_per_param(name: str, dp: int) -> tuple[tuple[float, float, float], str]:
    """(param, grad, optimizer-state) bytes per model parameter held per rank after backward, and a label.

    ZeRO paper with fp32 AdamW: stage 0 = 4+4+8 = 16; stage 1 = 4+4+8/dp; stage 2 = 4+4/dp+8/dp (the paper's
    stage 2 keeps full parameters); stage 3 = 16/dp. FSDP2 reshards parameters after backward whether or not it
    resharded them after forward, so at the moment measured here stage 2 (and fsdp2-noreshard) hold 16/dp, like
    stage 3; the difference is during forward/backward, where stage 2 keeps the gathered parameters (4 B).
    """
    kind, options, _ = CONFIGS[name]
    if kind == "ddp":
        return (4, 4, 8), "16"
    if kind == "fsdp2":
        return (4 / dp, 4 / dp, 8 / dp), "16/dp"
    stage = options["zero_stage"]
    return {
        0: ((4, 4, 8), "16"),
        1: ((4, 4, 8 / dp), "4+4+8/dp"),
        2: ((4 / dp, 4 / dp, 8 / dp), "16/dp"),
        3: ((4 / dp, 4 / dp, 8 / dp), "16/dp"),
    }[stage]


def analytic_comm(name: str, dp: int, n_params: int, n_root: int) -> tuple[float, str]:
    """Bytes each rank sends per step for gradients and parameters (fp32, ring collectives), and the formula.

    All-reduce of B bytes: 2(dp-1)/dp*B; all-gather and reduce-scatter of a B-byte (unsharded) tensor:
    (dp-1)/dp*B; broadcasts of B bytes split over dp owners: (dp-1)/dp*B per rank on average. Stage 3 gathers
    the blocks twice (forward and backward) but the root module's parameters (``n_root``: embeddings, head,
    final norm) once, since they stay gathered from forward to backward (FSDP2's default for the root, and
    HybridStrategy's explicit choice).
    """
    kind, options, _ = CONFIGS[name]
    f = (dp - 1) / dp
    full = 4 * n_params
    blocks = 4 * (n_params - n_root)
    stage = options.get("zero_stage")
    if kind == "ddp" or stage == 0:
        return 2 * f * full, "AR grads: 2(dp-1)/dp*4N"
    if stage == 1:
        return 3 * f * full, "AR grads + BC owned params: 3(dp-1)/dp*4N (ideal RS+AG: 2(dp-1)/dp*4N)"
    if stage == 2 or (kind == "fsdp2" and options["reshard_after_forward"] is False):
        return 2 * f * full, "AG params fwd + RS grads: 2(dp-1)/dp*4N"
    return 2 * f * full + f * blocks, "AG fwd + AG bwd (blocks only) + RS: (dp-1)/dp*(3*4N - 4N_root)"


# ----------------------------------------------------------------------------------------------- in the ranks
def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _gathered_bytes(module: torch.nn.Module) -> Optional[int]:
    """Bytes held by FSDP2/replicate unsharded-parameter buffers (torch internals; ``None`` if none/unknown)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    total, seen, found = 0, set(), False
    try:
        for submodule in module.modules():
            if not isinstance(submodule, FSDPModule):
                continue
            group = submodule._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            for fsdp_param in group.fsdp_params:
                found = True
                for tensor in getattr(fsdp_param, "all_gather_outputs", []):
                    storage = tensor.untyped_storage()
                    if storage.nbytes() and storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        total += storage.nbytes()
    except Exception:  # private API changed: report unknown instead of failing the benchmark
        return None
    return total if found else None


def _memory(trainer: Any, module: torch.nn.Module) -> dict[str, Any]:
    params = list({id(p): p for p in module.parameters()}.values())
    optim_bytes, with_state = 0, 0
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            with_state += 1
            optim_bytes += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optim": optim_bytes,
        "gathered": _gathered_bytes(module),
        "n_params": len(params),
        "n_with_grad": sum(p.grad is not None for p in params),
        "n_with_state": with_state,
    }


_COLLECTIVES = {
    "allreduce": "AR",
    "all_reduce": "AR",
    "allgather": "AG",
    "all_gather": "AG",
    "reduce_scatter": "RS",
    "broadcast": "BC",
    "barrier": "BAR",
}


def _collectives(profiler: Any, world: int) -> dict[str, Any]:
    """The collectives a profiled step issued, from the profiler's c10d dispatcher ops and gloo work items.

    ``counts``: c10d ops per kind (what the wrapper asked for). ``wire``: bytes sent per rank, ring-equivalent,
    from the gloo work items' shapes (fp32 assumed): all-reduce 2(w-1)/w*B, all-gather (w-1)*B_in, broadcast
    (w-1)/w*B. gloo runs FSDP2's reduce-scatter as an all-reduce of the whole unsharded gradient, so it is
    counted as RS but costs an all-reduce here.
    """
    counts: Counter = Counter()
    wire = 0.0
    trace = []
    f = (world - 1) / world
    for event in sorted(profiler.events(), key=lambda e: e.time_range.start):
        name = event.name
        if not name.startswith(("c10d::", "gloo:")):
            continue
        kind = next((v for k, v in _COLLECTIVES.items() if k in name.lower()), None)
        shapes = [list(shape) for shape in (event.input_shapes or []) if shape]
        trace.append((name, shapes))
        if kind is None:
            continue
        if name.startswith("c10d::"):
            counts[kind] += 1
            continue
        numel = sum(math.prod(shape) for shape in shapes if all(isinstance(d, int) for d in shape)) or 1
        wire += 4 * numel * {"AR": 2 * f, "AG": world - 1, "BC": f}.get(kind, 0.0)
    return {"counts": dict(counts), "wire": wire, "trace": trace}


@contextmanager
def _quiet_fds(enabled: bool) -> Iterator[None]:
    """Send this process's stdout/stderr file descriptors to /dev/null while the block runs."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def _make_probe(mem_step: int, profile_step: int, verbose: bool) -> Any:
    import lightning as L

    class BenchProbe(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            # forward (+zero_grad), backward, optimizer step: wall, then process CPU time
            self.phases: list[tuple[float, float, float, float, float, float]] = []
            self._marks: dict[str, tuple[float, float]] = {}
            self.memory: Optional[dict[str, Any]] = None
            self.gathered_after_forward: Optional[int] = None
            self.comm: Optional[dict[str, Any]] = None
            self._profiler: Any = None
            self._t0 = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == profile_step:
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                with _quiet_fds(not verbose):  # kineto prints start/stop lines on the raw file descriptors
                    self._profiler.__enter__()
            self._t0 = time.perf_counter()
            self._c0 = time.process_time()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if trainer.global_step == mem_step and self.gathered_after_forward is None:
                self.gathered_after_forward = _gathered_bytes(pl_module)
            self._marks["before_backward"] = (time.perf_counter(), time.process_time())

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._marks["after_backward"] = (time.perf_counter(), time.process_time())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == mem_step and self.memory is None:
                self.memory = _memory(trainer, pl_module)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            elapsed = time.perf_counter() - self._t0
            cpu = time.process_time() - self._c0
            if self._profiler is not None:
                with _quiet_fds(not verbose):
                    self._profiler.__exit__(None, None, None)
                self.comm = _collectives(self._profiler, trainer.world_size)
                self._profiler = None
            else:
                self.times.append(elapsed)
                self.cpu_times.append(cpu)
                (b, cb), (a, ca) = self._marks["before_backward"], self._marks["after_backward"]
                end, cend = self._t0 + elapsed, self._c0 + cpu
                self.phases.append((b - self._t0, a - b, end - a, cb - self._c0, ca - cb, cend - ca))

    return BenchProbe()


def _make_module(kind: str, options: dict[str, Any], model_kwargs: dict[str, Any]) -> Any:
    from lightning_mgpu.demo import GPTLightningModule

    if kind != "fsdp2":
        return GPTLightningModule(**model_kwargs)

    reshard = options["reshard_after_forward"]

    class FSDP2ByHand(GPTLightningModule):
        """The demo module with FSDP2 applied by hand, as Lightning's ModelParallelStrategy docs do it."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            kwargs: dict[str, Any] = {"mesh": self.device_mesh["data_parallel"]}
            if reshard is not None:
                kwargs["reshard_after_forward"] = reshard
            for block in self.model.transformer.h:
                fully_shard(block, **kwargs)
            fully_shard(self.model, **kwargs)

    return FSDP2ByHand(**model_kwargs)


def _make_strategy(kind: str, options: dict[str, Any], devices: int) -> Any:
    from datetime import timedelta

    timeout = timedelta(seconds=120)
    if kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", timeout=timeout)
    if kind == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1, timeout=timeout)
    from lightning_mgpu import HybridStrategy

    return HybridStrategy(data_parallel_size=devices, timeout=timeout, **options)


def fit_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """One Trainer fit of configuration ``name`` in this rank; returns timings, memory and collectives."""
    if not args["verbose"]:
        warnings.filterwarnings("ignore")
        for logger_name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed"):
            logging.getLogger(logger_name).setLevel(logging.ERROR)
    import lightning as L

    from lightning_mgpu.demo import TextDataModule

    kind, options, _ = CONFIGS[name]
    L.seed_everything(SEED, verbose=False)
    model_kwargs = dict(
        block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"], seed=SEED
    )
    module = _make_module(kind, options, model_kwargs)
    datamodule = TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1)
    steps = args["steps"]
    probe = _make_probe(args["mem_step"], profile_step=steps, verbose=args["verbose"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args["devices"],
        strategy=_make_strategy(kind, options, args["devices"]),
        max_steps=steps + 1,  # the last step is profiled for collectives and not timed
        **QUIET_TRAINER,
        callbacks=[probe],
    )
    trainer.fit(module, datamodule)
    return {
        "rank": trainer.global_rank,
        "times": probe.times,
        "cpu_times": probe.cpu_times,
        "phases": probe.phases,
        "memory": probe.memory,
        "gathered_after_forward": probe.gathered_after_forward,
        "comm": probe.comm,
        "loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
    }


# ------------------------------------------------------------------------------------------------ the report
def _count_params(args: dict[str, Any]) -> tuple[int, int]:
    from lightning_mgpu.demo import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"]))
    total = sum(p.numel() for p in gpt.parameters())
    blocks = sum(p.numel() for p in gpt.transformer.h.parameters())
    return total, total - blocks


def _fmt_comm(comm: Optional[dict[str, Any]]) -> str:
    if not comm:
        return "?"
    counts = comm["counts"]
    return " ".join(f"{k}{counts[k]}" for k in ("AR", "AG", "RS", "BC", "BAR") if counts.get(k))


def summarize(runs: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Pool the repeats of one configuration: per step the slowest rank, warm-up steps of every run dropped."""
    timed: list[float] = []
    cpu: list[float] = []
    phases: list[tuple[float, ...]] = []
    run_medians = []
    for outputs in runs:
        per_step = [max(steps) for steps in zip(*(o["times"] for o in outputs))]
        timed += per_step[warmup:]
        run_medians.append(statistics.median(per_step[warmup:]))
        cpu += [statistics.mean(steps) for steps in zip(*(o["cpu_times"] for o in outputs))][warmup:]
        phases += [tuple(map(statistics.mean, zip(*steps))) for steps in zip(*(o["phases"] for o in outputs))][warmup:]
    outputs = runs[0]
    memories = [o["memory"] for o in outputs if o["memory"]]
    rank0 = next(o for o in outputs if o["rank"] == 0)
    return {
        "median": statistics.median(timed),
        "min": min(timed),
        "cpu": statistics.median(cpu),
        "phases": [statistics.median(column) for column in zip(*phases)],
        "run_medians": run_medians,
        "memory": max(memories, key=lambda m: m["params"] + m["grads"] + m["optim"]) if memories else None,
        "gathered_after_forward": max((o["gathered_after_forward"] or 0) for o in outputs)
        if any(o["gathered_after_forward"] is not None for o in outputs)
        else None,
        "comm": rank0["comm"],
        "loss": rank0["loss"],
    }


def print_report(results: dict[str, dict[str, Any]], args: dict[str, Any], n_params: int, n_root: int) -> None:
    dp = args["devices"]
    n_mb = n_params / MB
    print()
    print(
        f"GPT n_layer={args['n_layer']} n_embd={args['n_embd']} n_head={args['n_head']} block_size={args['block_size']}:"
        f" N={n_params:,} params = {4 * n_params / MB:.2f} MB fp32 (outside the blocks: {n_root:,});"
        f" {dp} ranks x batch {args['batch_size']}, gloo, 1 thread/rank, torch {torch.__version__}."
    )
    print(
        f"Step ms: median (and min) over steps {args['warmup'] + 1}..{args['steps']} of {args['repeats']} run(s),"
        " the slowest rank per step. MB per rank."
    )
    head = (
        f"{'strategy':<16} {'step ms':>7} {'(min)':>6} {'peer':>15} {'ratio':>5} {'cpu ms':>6} {'ratio':>5} |"
        f" {'param':>5} {'grad':>5} {'optim':>5} {'total':>5} {'gath':>4} {'g.fwd':>5} |"
        f" {'ana p':>5} {'ana g':>5} {'ana o':>5} {'total':>5} {'B/param':>8} |"
        f" {'comm ana':>8} {'wire':>5} {'collectives/step':<16} {'loss':>5}"
    )
    print(head)
    print("-" * len(head))
    for name in ORDER:
        if name not in results:
            continue
        r = results[name]
        peer = CONFIGS[name][2]
        ratio = f"{r['median'] / results[peer]['median']:.2f}" if peer in results else ""
        cpu_ratio = f"{r['cpu'] / results[peer]['cpu']:.2f}" if peer in results else ""
        peer_label = (peer + ("*" if name == "hybrid-zero1" else "")) if peer else "-"
        (ap, ag, ao), label = analytic_bytes_per_param(name, dp)
        comm_bytes, _ = analytic_comm(name, dp, n_params, n_root)
        mem = r["memory"]
        if mem:
            gath = "-" if mem["gathered"] is None else f"{mem['gathered'] / MB:.2f}"
            total = mem["params"] + mem["grads"] + mem["optim"]
            flag = "!" if abs(total - (ap + ag + ao) * n_params) > 0.05 * (ap + ag + ao) * n_params else " "
            measured = (
                f"{mem['params'] / MB:5.2f} {mem['grads'] / MB:5.2f} {mem['optim'] / MB:5.2f} {total / MB:5.2f}{flag}{gath:>4}"
            )
        else:
            measured = f"{'?':>5} {'?':>5} {'?':>5} {'?':>5} {'?':>4}"
        gf = r["gathered_after_forward"]
        measured += f" {'-' if gf is None else f'{gf / MB:.2f}':>5}"
        wire = f"{r['comm']['wire'] / MB:5.2f}" if r["comm"] else "?"
        print(
            f"{name:<16} {r['median'] * 1e3:7.1f} {r['min'] * 1e3:6.1f} {peer_label:>15} {ratio:>5}"
            f" {r['cpu'] * 1e3:6.1f} {cpu_ratio:>5} | {measured} |"
            f" {ap * n_mb:5.2f} {ag * n_mb:5.2f} {ao * n_mb:5.2f} {(ap + ag + ao) * n_mb:5.2f} {label:>8} |"
            f" {comm_bytes / MB:8.2f} {wire:>5} {_fmt_comm(r['comm']):<16} {r['loss']:5.3f}"
        )
    print("phases, ms (median over steps of the ranks' mean): forward+zero_grad / backward / optimizer step")
    for n in ORDER:
        if n in results:
            ph = [f"{x * 1e3:.0f}" for x in results[n]["phases"]]
            print(f"  {n:<16} wall {'/'.join(ph[:3]):<12} cpu {'/'.join(ph[3:])}")
    if args["repeats"] > 1:
        print("per-run medians (ms): " + "; ".join(
            f"{n} " + "/".join(f"{m * 1e3:.0f}" for m in results[n]["run_medians"]) for n in ORDER if n in results
        ))
    print(
        f"""
ratio: step time / peer's. cpu ms: median per step of the ranks' mean process CPU time (all threads, gloo's
  included; waiting for a peer or for a core is not counted, so it is less sensitive to other jobs on the
  machine), and its ratio to the peer's. * no DeepSpeed ZeRO-1 here: stage 1 is compared with DDP (same gradient all-reduce).
param/grad/optim: bytes of the registered parameters (DTensor local shards), their .grad and the optimizer's state
  tensors, on the rank holding most, right after backward of optimizer step {args['mem_step']} (on_before_optimizer_step).
  gath: FSDP2/replicate unsharded-parameter buffers still allocated then ('-': not FSDP2-based);
  g.fwd: the same between forward and backward (on_before_backward), where stage 2 differs from stage 3.
  !: measured total more than 5% away from the analytic total.
ana p/g/o: analytic ZeRO bytes per parameter x N, fp32 AdamW: stage 0 = 4+4+8, stage 1 = 4+4+8/dp, stage 3 = 16/dp.
  Stage 2 in the ZeRO paper is 4+4/dp+8/dp (full parameters kept); FSDP2's reshard_after_forward=False still
  reshards parameters after backward, so 16/dp is what is expected here (4 B/param gathered during fwd+bwd).
comm ana: MB sent per rank per step for grads/params, ring algorithms:"""
    )
    for name in ORDER:
        if name in results:
            print(f"  {name:<16} {analytic_comm(name, dp, n_params, n_root)[1]}")
    print(
        """wire: the same, computed from the collectives gloo actually ran on one extra, untimed, profiled step (gloo runs
  a reduce-scatter as an all-reduce of the whole tensor, so RS costs 2(dp-1)/dp there, not (dp-1)/dp).
collectives/step: c10d ops on rank 0 in that step; AR all-reduce, AG all-gather, RS reduce-scatter, BC broadcast,
  BAR barrier. Every strategy has BAR1 + AR1 from `self.log(..., sync_dist=True)` (Lightning's _sync_ddp)."""
    )


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="processes (= data-parallel size) per run")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--mem-step", type=int, default=2, help="optimizer step at which memory is read")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved; steps pooled")
    parser.add_argument("--only", type=str, default="", help=f"comma-separated subset of {','.join(ORDER)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and torch's messages")
    ns = parser.parse_args(argv)
    args = vars(ns)
    if not 0 <= ns.warmup < ns.steps or not 0 <= ns.mem_step < ns.steps or ns.repeats < 1:
        parser.error("need 0 <= --warmup < --steps, 0 <= --mem-step < --steps and --repeats >= 1")
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or ORDER
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {ORDER}")

    try:
        import deepspeed  # noqa: F401

        print("note: deepspeed is importable, but DeepSpeed ZeRO-1/2 peers are not implemented (Lightning's")
        print("      DeepSpeedStrategy refuses CPU; it would need deepspeed.initialize by hand). Skipped.")
    except ImportError:
        print("note: deepspeed is not installed: no DeepSpeed ZeRO-1/2 peers for stages 1/2 (and Lightning's")
        print("      DeepSpeedStrategy refuses CPU anyway); stage 1 is compared with DDP instead.")

    # Import everything the ranks need before forking, so each job starts in ~1 s.
    import lightning  # noqa: F401

    import lightning_mgpu  # noqa: F401
    from lightning_mgpu.demo import TextDataModule

    n_params, n_root = _count_params(args)
    dm = TextDataModule(batch_size=ns.batch_size, block_size=ns.block_size, val_fraction=0.1)
    dm.setup()
    batches_per_epoch = len(dm.train_dataset) // ns.devices // ns.batch_size
    if batches_per_epoch < ns.steps + 1:
        print(f"note: {batches_per_epoch} batches per epoch per rank: runs cross epoch boundaries")

    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
    start = time.perf_counter()
    for repeat in range(ns.repeats):  # interleaved, so that slow drifts of the machine hit every configuration
        for name in names:
            if repeat and not runs[name]:
                continue  # failed before
            t0 = time.perf_counter()
            outputs = run_or_report(name, fit_job, ns.devices, name, args, timeout=ns.timeout, verbose=ns.verbose)
            if outputs is None:
                continue
            runs[name].append(outputs)
            median = summarize([outputs], ns.warmup)["median"]
            print(f"{name}: {median * 1e3:.1f} ms/step median ({time.perf_counter() - t0:.1f} s job)", flush=True)
    results = {name: summarize(done, ns.warmup) for name, done in runs.items() if done}
    print(f"total {time.perf_counter() - start:.0f} s")
    print_report(results, args, n_params, n_root)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
