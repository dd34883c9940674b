"""Benchmark tensor parallelism: HybridStrategy against the same plan by hand and Lightning's ModelParallelStrategy.

One invocation runs, each in its own set of ``--tp`` forked gloo processes (``tests/helpers/distributed.run_distributed``),
with the same demo GPT (``lightning_mgpu.demo``, nanoGPT with a fused ``c_attn``), seed, data and plan:

===============  ==============================================================================================
name             what
===============  ==============================================================================================
``hybrid``       (a) Lightning ``Trainer`` + ``HybridStrategy(tensor_parallel_size=tp, data_parallel_size=1)``,
                 ``tp_plan="auto"``, the demo ``GPTLightningModule`` unchanged
``by-hand``      (b) a plain PyTorch loop (AdamW with the demo's parameter groups, the same batches): the auto
                 plan written out per block and applied with torch's ``parallelize_module``; the style objects
                 are built with ``lightning_mgpu.parallel.tensor.style(...)``, so they are identical to (a)'s
                 (``_Colwise(chunks=3)`` for the fused q|k|v); head counts localized and, with sequence
                 parallelism, the remaining parameters replicated and the step run under ``implicit_replication``,
                 all by hand (``parallelize_by_hand``)
``lightning-mp``  (c) Lightning ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=tp)``, the demo
                 module subclassed to call ``parallelize_by_hand`` in ``configure_model``
===============  ==============================================================================================

plus, to separate Lightning's per-step overhead from the strategy's, an *empty* training step (one scalar
parameter, the demo's ``self.log(..., sync_dist=True)``, AdamW) in a plain loop, under Lightning's single-device
strategy (1 process), ``DDPStrategy``, ``ModelParallelStrategy`` and ``HybridStrategy`` (a no-op ``tp_plan``), and a
tiny Hugging Face Llama (``tests/helpers/modules.LlamaModule``) under ``HybridStrategy`` for its collectives only.

Measured (timing and memory with the harness's probe (``benchmarks/harness.py``), so the numbers mean the same there):

- step time: wall ``on_train_batch_start`` -> ``on_train_batch_end`` (the same span in the loop: forward, loss,
  ``zero_grad``, backward, optimizer step), per step the slowest rank, median after ``--warmup``; the process CPU
  time of the same span (mean of the ranks; less sensitive to other jobs on a shared machine); ``iter``: the same
  from one batch start to the next (adds data loading and the loop's bookkeeping between steps);
- collectives of one extra, untimed step, with torch's ``CommDebugMode`` (subclassed to also record each
  collective's tensor sizes, the phase of the step and the module issuing it): counts per kind and bytes, per
  block and outside the blocks, beside the analytic (Megatron-LM) expectation (``analytic_comm``);
- with ``--profile``, torch.profiler op counts of one more untimed step of (a) and (b), side by side.

Run ``python benchmarks/bench_tensor.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import time
import types
import warnings
from collections import Counter, defaultdict
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.harness import MB, QUIET_TRAINER, SEED, run_or_report, summarize  # noqa: E402

_make_probe = harness.make_step_probe
_quiet_fds = harness.quiet_fds


def _memory(trainer: Any, module: nn.Module) -> dict[str, int]:
    return harness.memory_per_rank(module, trainer.optimizers)

KB = 2**10
MAIN = {
    "hybrid": "(a) HybridStrategy, tp_plan='auto'",
    "by-hand": "(b) parallelize_module + plain loop",
    "lightning-mp": "(c) ModelParallelStrategy + same plan",
}
EMPTY = {
    "empty-loop": "plain loop",
    "empty-single": "Lightning single device (1 process)",
    "empty-ddp": "Lightning DDPStrategy",
    "empty-mp": "Lightning ModelParallelStrategy(dp=1, tp)",
    "empty-hybrid": "HybridStrategy(tp, no-op tp_plan)",
}
ORDER = [*MAIN, *EMPTY, "llama"]
LOOPS = ("by-hand", "empty-loop")  # the others run under Lightning's Trainer
KINDS = ("AR", "AG", "RS", "A2A", "BC")


# ------------------------------------------------------------------------------------------------ the plan by hand
def parallelize_by_hand(gpt: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """What ``tp_plan="auto"`` does to the demo GPT, written out for torch's ``parallelize_module``.

    The style objects come from ``lightning_mgpu.parallel.tensor.style``: identical to the auto plan's (fused
    q|k|v as ``_Colwise(chunks=3)``, i.e. ``_StridedShard`` so each rank keeps the q, k and v of its own heads).
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_mgpu.parallel.tensor import style

    sp = sequence_parallel
    tp = tp_mesh.size()
    for block in gpt.transformer.h:
        plan = {
            "attn.c_attn": style("colwise_qkv", sp),
            "attn.c_proj": style("rowwise", sp),
            "mlp.c_fc": style("colwise", sp),
            "mlp.c_proj": style("rowwise", sp),
        }
        if sp:
            plan.update({"ln_1": style("sequence_parallel", sp), "ln_2": style("sequence_parallel", sp)})
        parallelize_module(block, tp_mesh, plan)
        block.attn.n_head //= tp  # the attention's view(B, T, n_head, hs) must see this rank's heads
        block.attn.n_embd //= tp
    if sp:
        parallelize_module(gpt, tp_mesh, {
            "transformer.wte": style("embedding_rowwise", sp),
            "transformer.ln_f": style("sequence_parallel", sp),
            "lm_head": style("colwise_gather_output", sp),
        })
        # The residual stream is a DTensor: every other parameter (wpe) must be one too, replicated.
        for module in gpt.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    replicated = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                    module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _step_context(sequence_parallel: bool) -> Any:
    if not sequence_parallel:
        return nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


# ------------------------------------------------------------------------------------------ collectives recorder
def _comm_recorder() -> Any:
    """A ``CommDebugMode`` that also keeps, per collective: kind, phase, issuing module, tensor bytes, group size."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class CommRecorder(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict[str, Any]] = []
            self.phase = "fwd"  # set by the caller: fwd, bwd, opt

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
                return out  # DTensor desugars first; the collectives it issues come back here as plain ops
            packet = func._overloadpacket
            if packet in self.comm_registry or packet in c10d_collective_ops:
                self.records.append(self._describe(func, args))
            return out

        def _describe(self, func: Any, args: tuple) -> dict[str, Any]:
            name = str(func)
            eager = not name.startswith(("_c10d_functional", "c10d_functional", "_dtensor"))
            kind = next((k for p, k in (("all_reduce", "AR"), ("allreduce", "AR"), ("all_gather", "AG"),
                                        ("allgather", "AG"), ("reduce_scatter", "RS"), ("all_to_all", "A2A"),
                                        ("alltoall", "A2A"), ("broadcast", "BC")) if p in name), name)
            tensors = _flatten_tensors(args[0] if args else None)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            group = None
            if eager:  # c10d ops: (tensors, ProcessGroup, ...)
                for arg in args[1:]:
                    try:
                        group = int(torch.distributed.ProcessGroup.unbox(arg).size())
                        break
                    except Exception:
                        continue
            else:  # funcol ops end with the group's name
                names = [arg for arg in args[1:] if isinstance(arg, str)]
                group = _resolve_process_group(names[-1]).size() if names else None
            module = self.advanced_module_tracker.name
            return {"op": name.split(".")[1] if "." in name else name, "kind": kind, "eager": eager,
                    "phase": self.phase, "module": module.split(".", 1)[1] if "." in module else module,
                    "in_bytes": nbytes, "group": group}

    return CommRecorder()


def _flatten_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten_tensors(v)]
    return []


def _logical_and_ring(record: dict[str, Any], tp: int) -> tuple[float, float]:
    """(bytes of the full tensor, bytes each rank sends with a ring algorithm) of one recorded collective."""
    g = record["group"] or tp
    b = record["in_bytes"]
    if record["kind"] == "AG" and not record["eager"]:
        b *= g  # funcol all_gather's input is the local shard
    f = (g - 1) / g
    return b, (2 * f * b if record["kind"] == "AR" else f * b)


# ------------------------------------------------------------------------------------------------ in the ranks
def _quiet(verbose: bool) -> None:
    if verbose:
        return
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _model_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    return dict(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"],
                seed=SEED)


def _sharding(module: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, placements, local shape) per parameter, and the attention head counts: to compare runs' sharding."""
    from torch.distributed.tensor import DTensor

    rows = []
    for name, param in module.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        placements = str(tuple(param.placements)) if isinstance(param, DTensor) else "plain"
        rows.append((name.removeprefix("model."), placements, tuple(local.shape)))
    for name, child in module.named_modules():
        if hasattr(child, "n_head") and isinstance(child.n_head, int):
            rows.append((f"{name.removeprefix('model.')}.n_head", "attr", (child.n_head,)))
    return rows


def _op_counts(profiler: Any) -> dict[str, tuple[int, float]]:
    return {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in profiler.key_averages()}


def _make_callbacks(args: dict[str, Any]) -> tuple[Any, Any]:
    """The harness's timing/memory probe (its profiled step = our collectives step), + batch starts + comm + ops."""
    import lightning as L

    steps = args["steps"]
    probe = _make_probe(args["mem_step"], profile_step=steps, verbose=args["verbose"])

    class TensorParallelProbe(L.Callback):
        def __init__(self) -> None:
            self.starts: list[tuple[float, float]] = []
            self.records: Optional[list[dict[str, Any]]] = None
            self.ops: Optional[dict[str, tuple[int, float]]] = None
            self._mode: Any = None
            self._profiler: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append((time.perf_counter(), time.process_time()))
            if trainer.global_step == steps:
                self._mode = _comm_recorder()
                self._mode.__enter__()
            elif trainer.global_step == steps + 1 and args["profile"]:
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CPU])
                with _quiet_fds(not args["verbose"]):
                    self._profiler.__enter__()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self._mode is not None:
                self._mode.phase = "bwd"

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if self._mode is not None:
                self._mode.phase = "opt"

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self.records, self._mode = self._mode.records, None
            if self._profiler is not None:
                with _quiet_fds(not args["verbose"]):
                    self._profiler.__exit__(None, None, None)
                self.ops, self._profiler = _op_counts(self._profiler), None

    return probe, TensorParallelProbe()


def _empty_module(sequence_parallel: bool = False) -> Any:
    import lightning as L

    class EmptyStep(L.LightningModule):
        """One scalar parameter: a step is the loop's own work (hooks, closure, logging with sync, optimizer)."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def configure_model(self) -> None:
            pass  # ModelParallelStrategy insists on an override

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.w.square()
            self.log("train_loss", loss, prog_bar=True, sync_dist=True)  # as the demo module does
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([self.w], lr=3e-4)

    return EmptyStep()


def _gpt_module(name: str, args: dict[str, Any]) -> Any:
    from lightning_mgpu.demo import GPTLightningModule

    if name == "hybrid":
        return GPTLightningModule(**_model_kwargs(args))
    sp = args["sequence_parallel"]

    class TensorParallelByHand(GPTLightningModule):
        """The demo module with the plan applied by hand in configure_model, as Lightning's docs do it."""

        def configure_model(self) -> None:
            parallelize_by_hand(self.model, self.device_mesh["tensor_parallel"], sp)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            with _step_context(sp):
                return super().training_step(batch, batch_idx)

        def backward(self, loss: torch.Tensor, *a: Any, **kw: Any) -> None:
            with _step_context(sp):
                super().backward(loss, *a, **kw)

        def on_fit_start(self) -> None:
            if not args["mp_rehook"]:
                return
            # ModelParallelStrategy.setup() calls module.to(device) after configure_model; nn.Module._apply swaps
            # DTensor parameters (torch.utils.swap_tensors), and the fused bias's post-accumulate-grad hook that
            # _Colwise(chunks=3) registered no longer fires. Re-arm it (the Python-side dict survived the swap).
            from lightning_mgpu.parallel.tensor import _keep_grad_placement

            for block in self.model.transformer.h:
                bias = block.attn.c_attn.bias
                if bias is not None:
                    bias._post_accumulate_grad_hooks = None
                    bias.register_post_accumulate_grad_hook(_keep_grad_placement)

    return TensorParallelByHand(**_model_kwargs(args))


def _noop_plan(module: nn.Module, tp_mesh: Any) -> None:
    pass


def fit_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """One Trainer fit of run ``name`` in this rank; returns timings, memory, collectives and the sharding."""
    _quiet(args["verbose"])
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import TextDataModule
    from lightning_mgpu.parallel.blocks import find_block_container

    L.seed_everything(SEED, verbose=False)
    tp, sp = args["tp"], args["sequence_parallel"]
    steps = args["steps_for"][name]
    timeout = timedelta(seconds=120)
    devices = 1 if name == "empty-single" else tp
    dims: dict[str, Any] = {}
    if name == "llama":
        from tests.helpers.modules import LlamaModule, RandomTokenDataModule

        module = LlamaModule(num_key_value_heads=max(2, tp), seed=SEED)
        datamodule = RandomTokenDataModule(batch_size=args["batch_size"], seq_len=32)
        config = module.model.config
        dims = {"b": args["batch_size"], "s": 32, "h": config.hidden_size, "V": config.vocab_size,
                "L": config.num_hidden_layers, "qkv_bias": False, "max_pos": 0}
    elif name.startswith("empty"):
        module = _empty_module()
        datamodule = TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1)
    else:
        module = _gpt_module(name, args)
        datamodule = TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1)
    strategy: Any
    if name in ("hybrid", "llama"):
        strategy = HybridStrategy(tensor_parallel_size=tp, data_parallel_size=1, sequence_parallel=sp,
                                  loss_parallel=args["loss_parallel"], timeout=timeout)
    elif name == "empty-hybrid":
        strategy = HybridStrategy(tensor_parallel_size=tp, data_parallel_size=1, tp_plan=_noop_plan, timeout=timeout)
    elif name in ("lightning-mp", "empty-mp"):
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=tp, timeout=timeout)
    elif name == "empty-ddp":
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timeout)
    else:
        strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    probe, tp_probe = _make_callbacks({**args, "steps": steps})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps + 1 + int(args["profile"]),  # + the collectives step (+ the profiled step), untimed
        **QUIET_TRAINER,
        callbacks=[tp_probe, probe],
    )
    trainer.fit(module, datamodule)
    found = find_block_container(module)
    return {
        "rank": trainer.global_rank,
        "times": probe.times[:steps],  # the profiled step (if any) is timed by the harness's probe: drop it
        "cpu_times": probe.cpu_times[:steps],
        "phases": probe.phases[:steps],
        "starts": tp_probe.starts[: steps + 1],
        "memory": probe.memory,
        "gathered_after_forward": None,
        "comm": probe.comm,
        "records": tp_probe.records,
        "ops": tp_probe.ops,
        "sharding": _sharding(module) if not name.startswith("empty") else None,
        "blocks": found[0] if found else None,
        "dims": dims,
        "loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
    }


def loop_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The plain PyTorch loop: ``by-hand`` (the demo GPT, plan by hand) or ``empty-loop``."""
    _quiet(args["verbose"])
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mgpu.demo import GPT, GPTConfig, TextDataModule

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(SEED)
    tp, sp = args["tp"], args["sequence_parallel"] and name == "by-hand"
    steps = args["steps_for"][name]
    if name == "by-hand":
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        config = GPTConfig(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"],
                           n_embd=args["n_embd"])
        with torch.random.fork_rng(devices=[]):  # as GPTLightningModule(seed=SEED) builds it
            torch.manual_seed(SEED)
            model: nn.Module = GPT(config)
        parallelize_by_hand(model, mesh, sp)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(  # the demo's configure_optimizers: nanoGPT's groups
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    else:
        model = nn.Module()
        model.w = nn.Parameter(torch.ones(()))
        optimizer = torch.optim.AdamW([model.w], lr=3e-4)

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return model.w.square()

    datamodule = TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1)
    datamodule.setup()
    # Lightning's order: it swaps the train loader's sampler for DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED),
    # here over the one data-parallel replica that a tp-only layout has.
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(datamodule.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    batches = iter(DataLoader(datamodule.train_dataset, batch_size=args["batch_size"], sampler=sampler))
    times, cpu_times, phases, starts = [], [], [], []
    memory, records, ops, loss = None, None, None, torch.tensor(float("nan"))
    for step in range(steps + 1 + int(args["profile"])):
        x, y = next(batches)
        starts.append((time.perf_counter(), time.process_time()))
        recorder = _comm_recorder() if step == steps else None
        profiler = None
        if step == steps + 1:
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CPU])
            with _quiet_fds(not args["verbose"]):
                profiler.__enter__()
        if recorder is not None:
            recorder.__enter__()
        t0, c0 = time.perf_counter(), time.process_time()
        with _step_context(sp):
            loss = loss_fn(x, y)
        optimizer.zero_grad(set_to_none=True)
        b, cb = time.perf_counter(), time.process_time()
        if recorder is not None:
            recorder.phase = "bwd"
        with _step_context(sp):
            loss.backward()
        a, ca = time.perf_counter(), time.process_time()
        if recorder is not None:
            recorder.phase = "opt"
        if step == args["mem_step"]:
            memory = _memory(types.SimpleNamespace(optimizers=[optimizer]), model)
        optimizer.step()
        end, cend = time.perf_counter(), time.process_time()
        if recorder is not None:
            recorder.__exit__(None, None, None)
            records = recorder.records
        elif profiler is not None:
            with _quiet_fds(not args["verbose"]):
                profiler.__exit__(None, None, None)
            ops = _op_counts(profiler)
        else:
            times.append(end - t0)
            cpu_times.append(cend - c0)
            phases.append((b - t0, a - b, end - a, cb - c0, ca - cb, cend - ca))
    return {
        "rank": dist.get_rank(), "times": times, "cpu_times": cpu_times, "phases": phases, "starts": starts,
        "memory": memory, "gathered_after_forward": None, "comm": None, "records": records, "ops": ops,
        "sharding": _sharding(model) if name == "by-hand" else None,
        "blocks": "transformer.h" if name == "by-hand" else None, "dims": {},
        "loss": float(loss.detach()),
    }


def job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return (loop_job if name in LOOPS else fit_job)(name, args)


# --------------------------------------------------------------------------------------------------- analytics
def analytic_comm(model: str, d: dict[str, Any], tp: int, sp: bool, lp: bool = False) -> dict[tuple[str, str], Counter]:
    """Collectives per training step by (region, phase), Megatron-LM style: ``{kind: count}`` and ``{kind+"B": bytes}``.

    X = 4*b*s*h bytes (one fp32 activation of the residual stream). Per block, without sequence parallelism: the
    row-parallel attention output and MLP output are all-reduced in forward (2 AR of X), the input gradients of the
    column-parallel q|k|v and fc in backward (2 AR of X). With sequence parallelism each AR becomes an all-gather
    before the column-parallel layer and a reduce-scatter after the row-parallel one, in both directions (2 AG + 2 RS
    of X each way; same ring bytes). Extra terms of our plan: the fused q|k|v bias stays replicated, so its
    gradient (3h/tp per rank) is all-gathered once per block in backward. Outside the blocks: the demo GPT's auto
    plan shards nothing without SP; with SP the token embedding is vocab-parallel and reduce-scatters its output
    (RS of X forward, AG of X backward) and the head gathers its input (AG X forward, RS X backward) and its logits
    (AG of 4*b*s*V forward). The HF Llama plan always shards embedding and head: without SP the embedding output is
    all-reduced (AR X forward), the logits gathered (AG 4bsV forward) and the head's input gradient all-reduced
    (AR X backward). Its attention (q, k, v) and MLP (gate, up) have several column-parallel projections reading one
    input: converted once per module, they share one backward collective (so still 2 per block, not 5). With SP,
    the gradients of the parameters replicated on sequence shards (norms, GPT's wpe) are partial sums: all-reduced
    once each right after backward accumulates them (1 AR each, in backward), as Megatron does. With loss
    parallelism (``lp``) the head is vocab-parallel in every case and its logits are never gathered: the
    cross-entropy all-reduces three b*s vectors instead (row max, sum of exponentials, target logit: 3 AR of 4*b*s
    forward, none backward); the demo GPT's head, replicated without SP otherwise, then all-reduces its input
    gradient (AR X backward).
    """
    b, s, h, V, L = d["b"], d["s"], d["h"], d["V"], d["L"]
    X = 4 * b * s * h
    out: dict[tuple[str, str], Counter] = defaultdict(Counter)

    def add(region: str, phase: str, kind: str, n: int, nbytes: float) -> None:
        out[(region, phase)][kind] += n
        out[(region, phase)][kind + "B"] += n * nbytes

    def logits() -> None:
        if lp:
            add("outside", "fwd", "AR", 3, 4 * b * s)
        else:
            add("outside", "fwd", "AG", 1, 4 * b * s * V)

    for phase in ("fwd", "bwd"):
        if sp:
            add("block", phase, "AG", 2, X)
            add("block", phase, "RS", 2, X)
        else:
            add("block", phase, "AR", 2, X)
    if d["qkv_bias"]:
        add("block", "bwd", "AG", 1, 4 * 3 * h)
    if sp:
        add("outside", "fwd", "RS", 1, X)
        add("outside", "fwd", "AG", 1, X)
        logits()
        add("outside", "bwd", "AG", 1, X)
        add("outside", "bwd", "RS", 1, X)
        # Norms (GPT LayerNorm weight + bias, Llama RMSNorm weight; 2 per block and the final one) and GPT's wpe:
        # their partial gradients are all-reduced once, as soon as backward has accumulated them.
        per_norm = 2 if model == "gpt" else 1
        add("block", "bwd", "AR", 2 * per_norm, 4 * h)
        add("outside", "bwd", "AR", per_norm, 4 * h)
        if model == "gpt":
            add("outside", "bwd", "AR", 1, 4 * d["max_pos"] * h)
    elif model == "llama" or lp:
        if model == "llama":
            add("outside", "fwd", "AR", 1, X)
        logits()
        add("outside", "bwd", "AR", 1, X)
    return out


def measured_comm(records: list[dict[str, Any]], blocks: Optional[str], tp: int) -> dict[str, Any]:
    """Group the recorded collectives: per block index, outside the blocks, optimizer step, eager c10d (logging)."""
    per_block: dict[int, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    regions: dict[tuple[str, str], Counter] = defaultdict(Counter)
    pattern = re.compile(re.escape(blocks) + r"\.(\d+)(\.|$)") if blocks else None
    for r in records:
        logical, ring = _logical_and_ring(r, tp)
        if r["eager"]:
            key: tuple[str, str] = ("logging", "")
        elif r["phase"] == "opt":
            key = ("optimizer", "opt")
        else:
            match = pattern.search(r["module"]) if pattern else None
            if match:
                c = per_block[int(match.group(1))][r["phase"]]
                c[r["kind"]] += 1
                c[r["kind"] + "B"] += logical
                c["ring"] += ring
                continue
            key = ("outside", r["phase"])
        regions[key][r["kind"]] += 1
        regions[key][r["kind"] + "B"] += logical
        regions[key]["ring"] += ring
        if r["eager"]:
            regions[key]["group"] = r["group"] or 0
    return {"blocks": per_block, "regions": regions}


def _ring(c: Counter, tp: int) -> float:
    f = (tp - 1) / tp
    return sum(c.get(k + "B", 0) * (2 * f if k == "AR" else f) for k in KINDS)


def _fmt_bytes(n: float) -> str:
    if n >= MB:
        return f"{n / MB:.2f} MB"
    if n >= KB:
        return f"{n / KB:.1f} KB"
    return f"{n:.0f} B"


def _fmt_comm(c: Optional[Counter], tp: int, ring: Optional[float] = None) -> str:
    if not c or not any(c.get(k) for k in KINDS):
        return "-"
    parts = [f"{c[k]} {k} {_fmt_bytes(c[k + 'B'])}" for k in KINDS if c.get(k)]
    return " + ".join(parts) + f"  (ring {_fmt_bytes(_ring(c, tp) if ring is None else ring)})"


def _total(c_list: list[Counter]) -> Counter:
    t: Counter = Counter()
    for c in c_list:
        t.update({k: v for k, v in c.items() if k != "group"})
    return t


# ------------------------------------------------------------------------------------------------ the report
def _iter_summary(outputs: list[dict[str, Any]], warmup: int) -> tuple[float, float]:
    """Median batch-start-to-next-batch-start time (slowest rank) and mean-of-ranks CPU time, after warm-up."""
    walls = [[b[0] - a[0] for a, b in zip(o["starts"], o["starts"][1:])] for o in outputs]
    cpus = [[b[1] - a[1] for a, b in zip(o["starts"], o["starts"][1:])] for o in outputs]
    wall = [max(step) for step in zip(*walls)][warmup:]
    cpu = [statistics.mean(step) for step in zip(*cpus)][warmup:]
    return statistics.median(wall), statistics.median(cpu)


def print_timing(res: dict[str, dict[str, Any]], args: dict[str, Any]) -> None:
    tp = args["tp"]
    peer = res.get("by-hand")
    print(f"\nStep time, ms: median over steps {args['warmup'] + 1}..{args['steps']} of {args['repeats']} run(s), the slowest"
          f" rank per step; cpu: mean of the {tp} ranks' process CPU time. ratio: / (b).")
    head = (f"{'run':<40} {'step':>6} {'ratio':>5} {'(min)':>6} {'ratio':>5} {'cpu':>6} {'ratio':>5} {'iter':>6} {'ratio':>5}"
            f" | {'fwd/bwd/opt wall':>16} | {'param':>5} {'grad':>5} {'optim':>5} MB | {'loss':>6} sharding")
    print(head)
    print("-" * len(head))
    ref_sharding = res.get("hybrid", {}).get("sharding")
    for name, label in MAIN.items():
        if name not in res:
            continue
        r = res[name]
        ratio = lambda key: f"{r[key] / peer[key]:.2f}" if peer else ""  # noqa: E731
        mem = r["memory"]
        mem_s = f"{mem['params'] / MB:5.2f} {mem['grads'] / MB:5.2f} {mem['optim'] / MB:5.2f}" if mem else f"{'?':>17}"
        ph = "/".join(f"{x * 1e3:.0f}" for x in r["phases"][:3])
        same = "" if ref_sharding is None else ("= (a)" if r["sharding"] == ref_sharding else "DIFFERS from (a)")
        print(f"{label:<40} {r['median'] * 1e3:6.1f} {ratio('median'):>5} {r['min'] * 1e3:6.1f} {ratio('min'):>5} {r['cpu'] * 1e3:6.1f}"
              f" {ratio('cpu'):>5} {r['iter'] * 1e3:6.1f} {ratio('iter'):>5} | {ph:>16} | {mem_s} | {r['loss']:6.4f} {same}")
        if ref_sharding is not None and r["sharding"] != ref_sharding:
            diff = [(x, y) for x, y in zip(ref_sharding, r["sharding"]) if x != y][:3]
            print(f"    first differences (a) vs this: {diff}")
    if args["repeats"] > 1:
        print("per-run step medians (ms): " + "; ".join(
            f"{n} " + "/".join(f"{m * 1e3:.1f}" for m in res[n]["run_medians"]) for n in MAIN if n in res))
        if peer and "hybrid" in res:
            pairs = zip(res["hybrid"]["run_medians"], peer["run_medians"], res["hybrid"]["run_cpus"], peer["run_cpus"])
            print("per-repeat (a)/(b), wall / cpu: " + "  ".join(f"{a / b:.2f} / {ca / cb:.2f}" for a, b, ca, cb in pairs))

    empties = [n for n in EMPTY if n in res]
    if empties:
        print(f"\nEmpty training step (1 scalar parameter, self.log(sync_dist=True), AdamW), {tp} processes unless noted:"
              f" the loop's own per-step cost, ms")
        print(f"{'run':<40} {'step':>6} {'cpu':>6} {'iter':>6} {'cpu':>6}")
        for n in empties:
            r = res[n]
            print(f"{EMPTY[n]:<40} {r['median'] * 1e3:6.2f} {r['cpu'] * 1e3:6.2f} {r['iter'] * 1e3:6.2f} {r['iter_cpu'] * 1e3:6.2f}")
    a, b, c = res.get("hybrid"), res.get("by-hand"), res.get("lightning-mp")
    if a and b:
        print("\nWhere (a) - (b) goes, ms per step (wall / cpu):")
        print(f"  (a) - (b)                                       {(a['median'] - b['median']) * 1e3:+6.2f} / {(a['cpu'] - b['cpu']) * 1e3:+6.2f}"
              f"   per iteration {(a['iter'] - b['iter']) * 1e3:+6.2f} / {(a['iter_cpu'] - b['iter_cpu']) * 1e3:+6.2f}")
        if c:
            print(f"  (c) - (b)                                       {(c['median'] - b['median']) * 1e3:+6.2f} / {(c['cpu'] - b['cpu']) * 1e3:+6.2f}"
                  f"   per iteration {(c['iter'] - b['iter']) * 1e3:+6.2f} / {(c['iter_cpu'] - b['iter_cpu']) * 1e3:+6.2f}")
        pairs = [("empty-mp", "empty-loop", "Lightning loop, empty step (MP - loop)"),
                 ("empty-ddp", "empty-loop", "Lightning loop, empty step (DDP - loop)"),
                 ("empty-single", "empty-loop", "Lightning loop, empty step (1 device - loop)"),
                 ("empty-hybrid", "empty-mp", "HybridStrategy over ModelParallelStrategy, empty")]
        for x, y, label in pairs:
            if x in res and y in res:
                rx, ry = res[x], res[y]
                print(f"  {label:<47} {(rx['median'] - ry['median']) * 1e3:+6.2f} / {(rx['cpu'] - ry['cpu']) * 1e3:+6.2f}"
                      f"   per iteration {(rx['iter'] - ry['iter']) * 1e3:+6.2f} / {(rx['iter_cpu'] - ry['iter_cpu']) * 1e3:+6.2f}")
        ok = a["median"] <= 1.05 * b["median"]
        ok_cpu = a["cpu"] <= 1.05 * b["cpu"]
        print(f"  target (a) <= 1.05 x (b): wall {a['median'] / b['median']:.3f} {'met' if ok else 'NOT met'},"
              f" cpu {a['cpu'] / b['cpu']:.3f} {'met' if ok_cpu else 'NOT met'}")


def print_comm(res: dict[str, dict[str, Any]], args: dict[str, Any], gpt_dims: dict[str, Any]) -> None:
    tp, sp, lp = args["tp"], args["sequence_parallel"], args["loss_parallel"]
    print(f"\nCollectives per training step, tp={tp}{' + sequence parallel' if sp else ''}{' + loss parallel' if lp else ''}:"
          " torch CommDebugMode on rank 0"
          " over one untimed step (forward, backward, optimizer step).")
    print("  N KIND bytes: count, and bytes of the full (unsharded) tensors; ring: bytes each rank sends with ring"
          " algorithms (AR 2(tp-1)/tp, AG/RS (tp-1)/tp of the full tensor).")
    for name, model, dims, title in (("hybrid", "gpt", gpt_dims, "demo GPT, (a) HybridStrategy"),
                                     ("llama", "llama", res.get("llama", {}).get("dims"), "tiny HF Llama, HybridStrategy")):
        r = res.get(name)
        if not r or r.get("records") is None:
            continue
        d = dims
        ana = analytic_comm(model, d, tp, sp, lp)
        meas = measured_comm(r["records"], r["blocks"], tp)
        print(f"\n{title}: b={d['b']} s={d['s']} h={d['h']} V={d['V']} layers={d['L']}; X = 4*b*s*h = {_fmt_bytes(4 * d['b'] * d['s'] * d['h'])}")
        print(f"  {'region':<22} {'phase':<5} {'measured':<58} {'analytic (Megatron)':<50}")
        blocks = meas["blocks"]
        signatures = {i: {p: dict(c) for p, c in blk.items()} for i, blk in blocks.items()}
        first = min(blocks) if blocks else None
        same = all(sig == signatures[first] for sig in signatures.values()) if blocks else True
        label = f"each block (x{len(blocks)})" if same else "block 0"
        rows = []
        for phase in ("fwd", "bwd"):
            rows.append((label, phase, blocks[first][phase] if first is not None else None, ana.get(("block", phase))))
        for phase in ("fwd", "bwd"):
            rows.append(("outside the blocks", phase, meas["regions"].get(("outside", phase)), ana.get(("outside", phase))))
        rows.append(("optimizer step", "", meas["regions"].get(("optimizer", "opt")), ana.get(("optimizer", "opt"))))
        for region, phase, m, a in rows:
            flag = " " if _comparable(m) == _comparable(a) else "!"
            print(f"{flag} {region:<22} {phase:<5} {_fmt_comm(m, tp):<58} {_fmt_comm(a, tp):<50}")
        if not same:
            for i in sorted(blocks)[1:]:
                if signatures[i] != signatures[first]:
                    print(f"    block {i} differs: " + "; ".join(f"{p} {_fmt_comm(c, tp)}" for p, c in blocks[i].items()))
        total_m = _total([c for blk in blocks.values() for c in blk.values()]
                         + [c for k, c in meas["regions"].items() if k[0] != "logging"])
        total_a = _total([c for (region, _), c in ana.items() if region != "block"] + [c for (region, _), c in ana.items()
                                                                                    if region == "block"] * d["L"])
        flag = " " if _comparable(total_m) == _comparable(total_a) else "!"
        print(f"{flag} {'total':<22} {'':<5} {_fmt_comm(total_m, tp):<58} {_fmt_comm(total_a, tp):<50}")
        log = meas["regions"].get(("logging", ""))
        if log:
            print(f"  + eager c10d (Lightning self.log(sync_dist=True)): {log['AR']} AR of {_fmt_bytes(log['ARB'])} over a"
                  f" group of {log['group']}")
        if r.get("comm"):
            rs = total_m.get("RSB", 0) * (tp - 1) / tp
            print(f"  cross-check, gloo work items of the same step (the harness's profiler count): "
                  f"{_fmt_bytes(r['comm']['bytes'])} ring-equivalent"
                  + (f" (gloo runs reduce-scatter as an all-reduce: expected ring + {_fmt_bytes(rs)} ="
                     f" {_fmt_bytes(_ring(total_m, tp) + rs)})" if rs else ""))
        opt = meas["regions"].get(("optimizer", "opt"))
        ana_opt = ana.get(("optimizer", "opt"))
        if opt and ana_opt and opt.get("AR") and ana_opt.get("AR"):
            print(f"  optimizer step: {opt['AR']} AR for {ana_opt['AR']} parameters with Partial(sum) gradients"
                  f" ({opt['AR'] / ana_opt['AR']:.1f} each): DTensor redistributes such a gradient on every use"
                  " inside AdamW instead of once after backward.")
        mem = r.get("memory")
        if mem and mem["grads"] > mem["params"] * 1.001:
            print(f"  gradients hold {_fmt_bytes(mem['grads'] - mem['params'])} more than the parameters per rank:"
                  " a sharded parameter got a replicated (full-size) gradient.")
    others = [(n, MAIN[n]) for n in ("by-hand", "lightning-mp") if res.get(n, {}).get("records") is not None]
    if others and res.get("hybrid", {}).get("records") is not None:
        print("\nThe same step's collectives in the other runs, compared with (a)'s (logging left out):")
        ref = _by_region(res["hybrid"], tp)
        for n, label in others:
            mine = _by_region(res[n], tp)
            log = measured_comm(res[n]["records"], res[n]["blocks"], tp)["regions"].get(("logging", ""))
            log_s = f"; + {log['AR']} AR logging over a group of {log['group']}" if log else "; no logging collective"
            diff = [k for k in sorted(set(ref) | set(mine)) if _comparable(ref.get(k)) != _comparable(mine.get(k))]
            if not diff:
                print(f"  {label}: same{log_s}")
                continue
            print(f"! {label}: DIFFERENT{log_s}")
            for region, phase in diff:
                print(f"    {region} {phase}: {_fmt_comm(mine.get((region, phase)), tp)}   (a): {_fmt_comm(ref.get((region, phase)), tp)}")
            if n == "lightning-mp" and not args["mp_rehook"]:
                print("    (the fused q|k|v bias gradient hook of _Colwise(chunks=3) is lost when ModelParallelStrategy.setup()"
                      " calls module.to() after configure_model: the bias gradient stays _StridedShard and AdamW gathers"
                      " it on each use; --mp-rehook re-arms the hook)")


def _by_region(r: dict[str, Any], tp: int) -> dict[tuple[str, str], Counter]:
    """All blocks summed per phase, outside the blocks per phase, optimizer step (eager c10d logging left out)."""
    m = measured_comm(r["records"], r["blocks"], tp)
    out: dict[tuple[str, str], Counter] = {k: c for k, c in m["regions"].items() if k[0] != "logging"}
    for phase in ("fwd", "bwd"):
        blocks = [blk[phase] for blk in m["blocks"].values() if phase in blk]
        if blocks:
            out[("all blocks", phase)] = _total(blocks)
    return out


def _comparable(c: Optional[Counter]) -> dict[str, float]:
    if not c:
        return {}
    return {k: round(v) for k, v in c.items() if v and (k in KINDS or k[:-1] in KINDS or k[:-1] == "A2A")}


def print_ops(res: dict[str, dict[str, Any]], top: int = 25) -> None:
    a, b = res.get("hybrid", {}).get("ops"), res.get("by-hand", {}).get("ops")
    if not a or not b:
        return
    print("\ntorch.profiler, one untimed step on rank 0: ops whose count differs between (a) and (b), by self CPU"
          " time of (a)")
    print(f"  {'op':<52} {'(a) n':>6} {'ms':>7} {'(b) n':>6} {'ms':>7}")
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, (0, 0.0))[1]))
    shown = 0
    for k in keys:
        na, ta = a.get(k, (0, 0.0))
        nb, tb = b.get(k, (0, 0.0))
        if na == nb:
            continue
        print(f"  {k[:52]:<52} {na:6d} {ta:7.2f} {nb:6d} {tb:7.2f}")
        shown += 1
        if shown >= top:
            break
    same = [k for k in keys if a.get(k, (0,))[0] == b.get(k, (0,))[0]]
    print(f"  ({len(same)} ops with the same count in both; totals (a) {sum(n for n, _ in a.values())} ops"
          f" {sum(t for _, t in a.values()):.1f} ms self CPU, (b) {sum(n for n, _ in b.values())} ops"
          f" {sum(t for _, t in b.values()):.1f} ms)")


def print_notes(args: dict[str, Any]) -> None:
    print(
        """
Notes. step: on_train_batch_start -> on_train_batch_end (the harness's probe; the loop times the same work: forward,
  loss, zero_grad, backward, optimizer step); iter: batch start to next batch start (adds data loading and what
  Lightning does between steps). cpu: process CPU time, all threads (less sensitive to other jobs on the machine).
  fwd/bwd/opt: wall ms of forward+zero_grad / backward / optimizer step. param/grad/optim: local bytes per rank
  after backward of step --mem-step. loss: rank 0's loss of the last step (the runs see the same batches in the
  same order, so (a), (b) and (c) should agree to float noise). sharding: per-parameter placements and local
  shapes and the attention head counts compared with (a)'s.
  (a) and (c) run the demo module's self.log("train_loss", sync_dist=True) each step; (b) logs nothing. The empty
  step measures exactly that kind of per-step loop cost without a model.
collectives: '!' marks a row where the measured count or bytes differ from the analytic (Megatron-LM) expectation
  (see analytic_comm's docstring for each term). Counted from on_train_batch_start to on_train_batch_end: Lightning
  also broadcasts a SIGTERM flag tensor once per step outside that span (in 'iter', not in 'step')."""
    )


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = processes per run")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism in (a), (b) and (c)")
    parser.add_argument("--loss-parallel", action="store_true",
                        help="loss_parallel=True in (a) and the Llama run ((b) and (c) keep gathering the logits)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run, warm-up included")
    parser.add_argument("--empty-steps", type=int, default=40, help="timed steps of the empty-step runs")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank (every rank of a tp group reads the same)")
    parser.add_argument("--mem-step", type=int, default=2, help="optimizer step at which memory is read")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per configuration (the Llama: once), interleaved; steps pooled")
    parser.add_argument("--only", type=str, default="", help=f"comma-separated subset of {','.join(ORDER)}")
    parser.add_argument("--no-empty", action="store_true", help="skip the empty-step baselines")
    parser.add_argument("--no-llama", action="store_true", help="skip the tiny HF Llama collectives run")
    parser.add_argument("--mp-rehook", action="store_true",
                        help="(c): re-arm the fused-bias gradient hook that ModelParallelStrategy's module.to() drops")
    parser.add_argument("--profile", action="store_true", help="torch.profiler op counts of (a) and (b), one step")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and torch's messages")
    ns = parser.parse_args(argv)
    args = vars(ns)
    if not 0 <= ns.warmup < min(ns.steps, ns.empty_steps) or not 0 <= ns.mem_step < ns.steps or ns.repeats < 1:
        parser.error("need 0 <= --warmup < --steps, --empty-steps; 0 <= --mem-step < --steps; --repeats >= 1")
    if ns.tp < 2:
        parser.error("--tp must be at least 2")
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or [
        n for n in ORDER if not (ns.no_empty and n in EMPTY) and not (ns.no_llama and n == "llama")]
    unknown = set(names) - set(ORDER)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; choose from {ORDER}")
    if "llama" in names and (4 % ns.tp or ns.tp > 4):
        print(f"note: the tiny Llama has 4 attention heads: no Llama run for tp={ns.tp}")
        names.remove("llama")
    args["steps_for"] = {n: (ns.empty_steps if n in EMPTY else 1 if n == "llama" else ns.steps) for n in ORDER}

    # Import everything the ranks need before forking, so each job starts in ~1 s.
    import lightning  # noqa: F401

    import lightning_mgpu  # noqa: F401
    from lightning_mgpu.demo import TextDataModule

    if "llama" in names:
        try:
            with _quiet_fds(not ns.verbose):  # torchao (pulled in by transformers) prints load failures
                from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

                from tests.helpers.modules import LlamaModule  # noqa: F401
        except ImportError:
            print("note: transformers is not importable: no Llama run")
            names.remove("llama")
    dm = TextDataModule(batch_size=ns.batch_size, block_size=ns.block_size, val_fraction=0.1)
    dm.setup()
    if len(dm.train_dataset) // ns.batch_size < max(ns.steps, ns.empty_steps) + 2:
        print("note: runs cross an epoch boundary")

    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    start = time.perf_counter()
    for repeat in range(ns.repeats):
        for name in names:
            if (repeat and not runs[name]) or (repeat and name == "llama"):
                continue
            world = 1 if name == "empty-single" else ns.tp
            t0 = time.perf_counter()
            outputs = run_or_report(name, job, world, name, args, timeout=ns.timeout, verbose=ns.verbose)
            if outputs is None:
                continue
            runs[name].append(outputs)
            median = summarize([outputs], ns.warmup)["median"] if name != "llama" else float("nan")
            print(f"{name}: {median * 1e3:.1f} ms/step median ({time.perf_counter() - t0:.1f} s job)", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")

    res: dict[str, dict[str, Any]] = {}
    for name, done in runs.items():
        if not done:
            continue
        rank0 = [next(o for o in outputs if o["rank"] == 0) for outputs in done]
        r = summarize(done, ns.warmup) if name != "llama" else {"comm": rank0[0]["comm"]}
        iters = [_iter_summary(outputs, ns.warmup) for outputs in done] if name != "llama" else [(0.0, 0.0)]
        r.update(run_cpus=[summarize([outputs], ns.warmup)["cpu"] for outputs in done] if name != "llama" else [],
                 iter=statistics.median(i[0] for i in iters), iter_cpu=statistics.median(i[1] for i in iters),
                 records=rank0[0]["records"], ops=rank0[0]["ops"], sharding=rank0[0]["sharding"],
                 blocks=rank0[0]["blocks"], dims=rank0[0]["dims"])
        res[name] = r

    tp = ns.tp
    print(f"\nGPT n_layer={ns.n_layer} n_embd={ns.n_embd} n_head={ns.n_head} block_size={ns.block_size}, batch {ns.batch_size};"
          f" tp={tp}{' + sequence parallel' if ns.sequence_parallel else ''}{' + loss parallel in (a)' if ns.loss_parallel else ''}"
          f" over {tp} gloo processes, 1 thread each,"
          f" torch {torch.__version__}, {os.cpu_count()} CPUs.")
    print_timing(res, args)
    gpt_dims = {"b": ns.batch_size, "s": ns.block_size, "h": ns.n_embd, "V": 256, "L": ns.n_layer, "qkv_bias": True,
                "max_pos": ns.block_size}
    print_comm(res, args, gpt_dims)
    if ns.profile:
        print_ops(res)
    print_notes(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
