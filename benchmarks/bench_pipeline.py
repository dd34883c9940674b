"""Benchmark pipeline parallelism: every torch schedule under HybridStrategy, against the same split run by hand.

One invocation runs, per schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) and per number of microbatches ``m`` (default ``2*pp`` and ``4*pp``; counts a schedule refuses are
skipped and named), one set of ``--pp`` forked gloo processes (``tests/helpers/distributed.run_distributed``) that
trains the demo GPT (``lightning_mgpu.demo``) twice on the same data, seed and split:

=============  ===================================================================================================
name           what
=============  ===================================================================================================
``lightning``  Lightning ``Trainer`` + ``HybridStrategy(pipeline_parallel_size=pp, pipeline_schedule=s,
               num_microbatches=m)``, the demo ``GPTLightningModule`` unchanged (stages run the whole network call
               with interception; the user's step is captured per microbatch and replayed as the loss function)
``hand``       a plain PyTorch loop, split the torchtitan way: the GPT's stages are built by keeping only their
               layers (``HandStage``: embeddings on stage 0, this stage's blocks, norm + head on the last stage),
               at the same cut points (``lightning_mgpu.parallel.pipeline.plan_split``) and stage placement
               (``stage_indices``) as HybridStrategy, wrapped in ``PipelineStage`` and run by the same torch
               schedule class with ``loss_fn = cross_entropy / m`` (``scale_grads=False``), then AdamW with the demo's
               parameter groups, on the batches Lightning trains on (its ``DistributedSampler(shuffle=True)``)
=============  ===================================================================================================

The two runs share the processes and the default process group (the hand loop initializes it, Lightning finds it
initialized); each runs ``--repeats`` times, their order alternating from one (repeat, m) to the next, timed steps
pooled. Their losses are printed side by side: they agree to the last digit.

Measured, per configuration, in every rank, by wrapping torch's pipelining internals in the worker processes
(nothing in the package is changed):

- step time: wall time of one optimizer step (Lightning: ``on_train_batch_start`` -> ``on_train_batch_end``; the
  hand loop: ``zero_grad``, ``schedule.step``, ``optimizer.step``), per step the slowest rank, median after
  ``--warmup`` (the first step also infers shapes); and the process CPU time of the same span (mean of the ranks;
  it does not count waiting for a peer or for a core, so it is less sensitive to other jobs on the machine);
- inside ``schedule.step``: wall time; *compute*, the time in ``PipelineStage.forward_one_chunk`` (F),
  ``backward_one_chunk`` (B, or I when the schedule splits the backward) and ``backward_weight_one_chunk`` (W), plus
  the loss function on the last stage (L), in wall and in thread CPU time; *p2p wait*, the time in torch's
  ``_wait_batch_p2p``; *p2p issue*, the time in torch's ``_batch_p2p`` (gloo ``isend``/``irecv`` calls), wall and
  thread CPU time; the rest is the schedule's own Python and, on a loaded machine, time the process waited for a
  core;
- Lightning only: the capture of the user's step per microbatch (``PipelineEngine._start``) and the broadcast of
  the loss and logged values (``PipelineEngine._publish``);
- once, before the schedules, on one process without pipelining: Lightning's own per-step cost (a plain
  ``Trainer`` vs a plain loop on the whole model), so that L/H can also be read without it (column ``-lit``);
- parameters held per rank (numel of the rank's stages) after training, beside the analytic split.

Bubble (idle fraction of each rank inside the schedule's step), three ways:

- ``theory``: (p-1)/(m+p-1) for GPipe/1F1B; (p-1)/(v*m+p-1) for Interleaved1F1B/LoopedBFS with v stages per rank;
  for the zero-bubble schedules only the first microbatch's forward ramp, (p-1)*F/v, is left: (p-1)/(3*v*m+p-1)
  with F=1, I=W=1 (B=2);
- ``sched``: an event simulation of torch's own schedule tables (``pipeline_order``, read with
  ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``): each rank runs its actions in the
  table's order, an action starts when its rank is free and its dependency (previous stage's F, next stage's B/I,
  own I for W) has finished, F=1, B=2, I=W=1 (time per rank-stage; v stages per rank scale all alike), communication
  free; bubble of rank r = 1 - busy_r / makespan. ``x th`` is sched/theory (target: within 1.2x);
- ``sim-meas``: the same simulation with the measured median F(+L), B, I, W of each stage, in thread CPU time
  (Lightning run / hand run): the bubble the schedule order implies with this model's real per-stage costs, without
  p2p latency or contention;
- ``measured``: per rank, (schedule.step wall - compute) / schedule.step wall, median over the timed steps
  (p2p waits + schedule overhead; 2 cores shared by ``pp`` ranks and other jobs make this noisy).

Run ``python benchmarks/bench_pipeline.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.harness import QUIET_TRAINER, SEED, run_or_report  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
COMPUTE_KINDS = ("F", "B", "I", "W", "L")
IMPLS = ("lightning", "hand")


# --------------------------------------------------------------------------------------- schedule-table analytics
def theory(schedule: str, p: int, m: int, v: int) -> tuple[float, str]:
    """Closed-form bubble fraction and its formula."""
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if schedule in ZERO_BUBBLE:
        return (p - 1) / (3 * v * m + p - 1), "(p-1)/(3vm+p-1)"
    return (p - 1) / (v * m + p - 1), "(p-1)/(vm+p-1)"


def schedule_tables(schedule: str, p: int, m: int, v: int) -> tuple[list[list[Any]], list[str]]:
    """Per rank, the compute actions (F, B, I, W; overlapped F+B expanded) of torch's table, and notes on fixes.

    torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards from 1 (``F1 B0 F2 B1 ...
    F{m}``: ``forward_mb`` starts at 0 and is incremented before its first use when there is no warm-up forward).
    The runtime does not read that table (1F1B's ``_step_microbatches`` is written out by hand), only the
    visualizer and a simulation like this one do. Every schedule runs a stage's forwards in microbatch order, so
    forwards whose numbers are off are renumbered by their order of appearance, and that is reported.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType as C

    raw = get_schedule_ops(schedule, p, m, num_stages_per_rank=v)
    tables, notes = [], []
    for rank, ops in enumerate(raw):
        actions: list[Any] = []
        for action in ops:
            if action is None:
                continue
            if action.computation_type == C.OVERLAP_F_B:
                actions += list(action.sub_actions or [])
            elif action.computation_type in (C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT):
                actions.append(action)
        seen: dict[int, int] = defaultdict(int)
        fixed = 0
        for i, action in enumerate(actions):
            if action.computation_type == C.FORWARD:
                expected = seen[action.stage_index]
                seen[action.stage_index] += 1
                if action.microbatch_index != expected:
                    actions[i] = action._replace(microbatch_index=expected)
                    fixed += 1
        if fixed:
            notes.append(f"rank {rank}: torch's table has {fixed} forward(s) out of microbatch order (1F1B's last rank:"
                         f" F1..F{m} for microbatches 0..{m - 1}), renumbered for the simulation")
        tables.append(actions)
    return tables, notes


def simulate(tables: list[list[Any]], num_stages: int, cost: Callable[[Any], float]) -> tuple[list[float], float]:
    """Run the per-rank action lists with durations ``cost(action)``; returns (bubble per rank, makespan)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    done: dict[tuple, float] = {}
    clock = [0.0] * len(tables)
    busy = [0.0] * len(tables)
    position = [0] * len(tables)
    while any(position[r] < len(tables[r]) for r in range(len(tables))):
        progress = False
        for rank, actions in enumerate(tables):
            while position[rank] < len(actions):
                a = actions[position[rank]]
                s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
                if kind == C.FORWARD:
                    needs = [] if s == 0 else [[(s - 1, C.FORWARD, mb)]]
                elif kind in (C.FULL_BACKWARD, C.BACKWARD_INPUT):
                    needs = ([[(s, C.FORWARD, mb)]] if s == num_stages - 1
                             else [[(s + 1, C.FULL_BACKWARD, mb), (s + 1, C.BACKWARD_INPUT, mb)]])
                else:  # W after this stage's I
                    needs = [[(s, C.BACKWARD_INPUT, mb)]]
                ready = 0.0
                for alternatives in needs:
                    finished = [done[d] for d in alternatives if d in done]
                    if not finished:
                        break
                    ready = max(ready, min(finished))
                else:
                    duration = cost(a)
                    clock[rank] = max(clock[rank], ready) + duration
                    busy[rank] += duration
                    done[(s, kind, mb)] = clock[rank]
                    position[rank] += 1
                    progress = True
                    continue
                break
        if not progress:
            stuck = [str(tables[r][position[r]]) for r in range(len(tables)) if position[r] < len(tables[r])]
            raise RuntimeError(f"schedule table deadlocks: next actions {stuck}")
    span = max(clock)
    return [1 - b / span for b in busy], span


def unit_cost(action: Any) -> float:
    return {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[action.computation_type.value]


def activation_peak(tables: list[list[Any]], v: int) -> list[float]:
    """Peak microbatch activations held per rank, in units of one whole rank's share of the model (1/v per stage).

    F stores one, B (or W, for a split backward) frees it.
    """
    peaks = []
    for actions in tables:
        held = peak = 0.0
        for a in actions:
            kind = a.computation_type.value
            held += 1 / v if kind == "F" else -1 / v if kind in ("B", "W") else 0.0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def analyze(schedule: str, p: int, m: int) -> dict[str, Any]:
    from lightning_mgpu.parallel.pipeline import stages_per_rank

    v = stages_per_rank(schedule, None)
    tables, notes = schedule_tables(schedule, p, m, v)
    bubbles, _ = simulate(tables, p * v, unit_cost)
    th, formula = theory(schedule, p, m, v)
    return {"v": v, "tables": tables, "notes": notes, "sched": bubbles, "theory": th, "formula": formula,
            "act": activation_peak(tables, v)}


# ------------------------------------------------------------------------------------------------- in the ranks
class _Recorder:
    """Per-step timings written by the wrappers installed by ``_instrument``."""

    def __init__(self) -> None:
        self.current: Optional[dict[str, Any]] = None

    def start(self) -> None:
        self.current = {"sched": 0.0, "sched_cpu": 0.0, "compute": 0.0, "compute_cpu": 0.0, "wait": 0.0,
                        "issue": 0.0, "issue_cpu": 0.0, "capture": 0.0, "publish": 0.0, "actions": defaultdict(list)}

    def stop(self) -> dict[str, Any]:
        record, self.current = self.current or {}, None
        record["actions"] = dict(record.get("actions", {}))
        return record

    def add(self, kind: str, stage: Optional[int], seconds: float, cpu: float) -> None:
        """``seconds`` of wall time and ``cpu`` seconds of this thread's CPU time spent in one action."""
        if self.current is None:
            return
        if kind in COMPUTE_KINDS:
            self.current["compute"] += seconds
            self.current["compute_cpu"] += cpu
            self.current["actions"][(kind, stage)].append((seconds, cpu))
        else:
            self.current[kind] += seconds
            if f"{kind}_cpu" in self.current:
                self.current[f"{kind}_cpu"] += cpu


_RECORDER: Optional[_Recorder] = None
# Per-action CPU clock (~1 us a call). A module global so that an A/B run can swap it for ``lambda: 0.0``: doing so
# changed no step time beyond the noise.
_THREAD_CLOCK: Callable[[], float] = time.thread_time


def _instrument() -> _Recorder:
    """Wrap torch's pipelining internals (and the engine's capture/publish) in this process, once."""
    global _RECORDER
    if _RECORDER is not None:
        return _RECORDER
    from torch.distributed.pipelining import schedules, stage

    from lightning_mgpu.parallel.pipeline_step import PipelineEngine

    rec = _RECORDER = _Recorder()

    def timed(owner: Any, name: str, kind_of: Callable[..., Optional[tuple[str, Optional[int]]]]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), _THREAD_CLOCK()
            try:
                return original(*args, **kwargs)
            finally:
                what = kind_of(*args, **kwargs)
                if what is not None:
                    rec.add(what[0], what[1], time.perf_counter() - t0, _THREAD_CLOCK() - c0)

        setattr(owner, name, wrapper)

    base = stage._PipelineStageBase
    timed(base, "forward_one_chunk", lambda self, *a, **k: ("F", self.stage_index))
    timed(base, "backward_one_chunk",
          lambda self, *a, **k: ("B" if k.get("full_backward", True) else "I", self.stage_index))
    timed(base, "backward_weight_one_chunk", lambda self, *a, **k: ("W", self.stage_index))
    timed(schedules._PipelineSchedule, "_maybe_compute_loss",
          lambda self, st, *a, **k: ("L", st.stage_index) if st.is_last and self._loss_fn is not None else None)
    timed(schedules, "_wait_batch_p2p", lambda *a, **k: ("wait", None))
    timed(schedules, "_batch_p2p", lambda *a, **k: ("issue", None))
    timed(PipelineEngine, "_start", lambda *a, **k: ("capture", None))
    timed(PipelineEngine, "_publish", lambda *a, **k: ("publish", None))

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        def make(original: Callable) -> Callable:
            @functools.wraps(original)
            def step(*args: Any, **kwargs: Any) -> Any:
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    if rec.current is not None:
                        rec.current["sched"] += time.perf_counter() - t0
                        rec.current["sched_cpu"] += time.process_time() - c0
            return step

        cls.step = make(cls.step)  # type: ignore[method-assign]
    return rec


class HandStage(nn.Module):
    """One stage of the demo GPT built the torchtitan way: this stage's layers kept, the others dropped (None)."""

    def __init__(self, gpt: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        t = gpt.transformer
        self.wte = t.wte if first else None
        self.wpe = t.wpe if first else None
        self.h = nn.ModuleDict({str(i): t.h[i] for i in blocks})
        self.ln_f = t.ln_f if last else None
        self.lm_head = gpt.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h.values():
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def _model_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    return dict(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"])


def _datamodule(args: dict[str, Any]) -> Any:
    from lightning_mgpu.demo import TextDataModule

    return TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The demo module's optimizer (``GPTLightningModule.configure_optimizers`` with its defaults)."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))


def _run_hand(schedule: str, m: int, args: dict[str, Any], rec: _Recorder) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_mgpu.demo import GPT, GPTConfig
    from lightning_mgpu.parallel.pipeline import plan_split, stage_indices, stages_per_rank

    pp, rank, device = args["pp"], dist.get_rank(), torch.device("cpu")
    config = GPTConfig(**_model_kwargs(args))
    with torch.random.fork_rng(devices=[]):  # the demo module's seeded init: the same weights as Lightning's run
        torch.manual_seed(SEED)
        gpt = GPT(config)
    per_rank = stages_per_rank(schedule, None)
    num_stages = pp * per_rank
    split = plan_split(gpt, num_stages, "auto")
    mine = stage_indices(schedule, rank, pp, per_rank)
    modules = [HandStage(gpt, split.blocks_of(s), s == 0, s == num_stages - 1) for s in mine]
    del gpt
    stages = [PipelineStage(module, s, num_stages, device) for s, module in zip(mine, modules)]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) / m

    schedule_class = get_schedule_class(schedule)
    pipe = schedule_class(stages[0] if len(stages) == 1 else stages, m, loss_fn=loss_fn, scale_grads=False)
    params = [p for module in modules for p in module.parameters()]
    optimizer = _adamw(params)
    dm = _datamodule(args)
    dm.setup()
    # The order Lightning trains in: it swaps the loader's sampler for DistributedSampler(shuffle=True) over the
    # data-parallel ranks (one here), seeded from PL_GLOBAL_SEED (0 when unset).
    sampler = DistributedSampler(dm.train_dataset, num_replicas=1, rank=0, shuffle=True,
                                 seed=int(os.getenv("PL_GLOBAL_SEED", 0)))
    steps = []
    for step, (x, y) in enumerate(DataLoader(dm.train_dataset, batch_size=args["batch_size"], sampler=sampler)):
        if step == args["steps"]:
            break
        rec.start()
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        inputs = (x,) if 0 in mine else ()
        targets = {"target": y, "losses": losses} if num_stages - 1 in mine else {}
        pipe.step(*inputs, **targets)
        optimizer.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        record = rec.stop()
        loss = float(torch.stack([l.detach() for l in losses]).sum()) if losses else None
        record.update(wall=wall, cpu=cpu, loss=loss)
        steps.append(record)
    return {"steps": steps, "numel": sum(p.numel() for p in params)}


def _run_lightning(schedule: str, m: int, args: dict[str, Any], rec: _Recorder) -> dict[str, Any]:
    import lightning as L

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            rec.start()
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            wall, cpu = time.perf_counter() - self._t0, time.process_time() - self._c0
            record = rec.stop()
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            record.update(wall=wall, cpu=cpu, loss=float(loss) if loss is not None else None)
            self.steps.append(record)

    module = GPTLightningModule(**_model_kwargs(args), seed=SEED)
    probe = Probe()
    strategy = HybridStrategy(pipeline_parallel_size=args["pp"], data_parallel_size=1, pipeline_schedule=schedule,
                              num_microbatches=m, timeout=timedelta(seconds=args["timeout"]))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args["pp"],
        strategy=strategy,
        max_steps=args["steps"],
        **QUIET_TRAINER,
        callbacks=[probe],
    )
    trainer.fit(module, _datamodule(args))
    return {"steps": probe.steps, "numel": sum(p.numel() for p in module.parameters())}


def framework_job(args: dict[str, Any]) -> dict[str, float]:
    """Lightning's own per-step cost, without any pipelining: one process trains the whole demo GPT with a plain
    ``Trainer`` (single device) and with a plain loop (same batches, forward + loss + backward + AdamW).

    The difference is what any Lightning run pays per step (loop, hooks, ``self.log``, the closure); the pipeline
    table's L/H ratio includes it, so the report also shows L/H with it taken out.
    """
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from lightning_mgpu.demo import GPTLightningModule

    times: dict[str, list[tuple[float, float]]] = {"lightning": [], "hand": []}

    class Probe(L.Callback):
        def on_train_batch_start(self, *unused: Any) -> None:
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, *unused: Any) -> None:
            times["lightning"].append((time.perf_counter() - self._t0, time.process_time() - self._c0))

    for _ in range(args["repeats"]):
        module = GPTLightningModule(**_model_kwargs(args), seed=SEED)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args["steps"], callbacks=[Probe()], **QUIET_TRAINER)
        trainer.fit(module, _datamodule(args))
        module = GPTLightningModule(**_model_kwargs(args), seed=SEED)
        optimizer = _adamw(list(module.parameters()))
        dm = _datamodule(args)
        dm.setup()
        for step, (x, y) in enumerate(DataLoader(dm.train_dataset, batch_size=args["batch_size"], shuffle=True)):
            if step == args["steps"]:
                break
            t0, c0 = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            logits = module(x)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
            optimizer.step()
            times["hand"].append((time.perf_counter() - t0, time.process_time() - c0))
    warm = args["warmup"]
    result = {}
    for impl, values in times.items():
        kept = [v for k, v in enumerate(values) if k % args["steps"] >= warm]
        result[f"{impl}_wall"] = _median([w for w, _ in kept])
        result[f"{impl}_cpu"] = _median([c for _, c in kept])
    return result


def schedule_job(schedule: str, ms: list[int], args: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """In one rank: ``--repeats`` times, for each m, the hand loop and the Lightning fit, on one process group.

    The order of the two alternates from one (repeat, m) to the next, so that a slow drift of the machine hits both.
    """
    if not args["verbose"]:
        warnings.filterwarnings("ignore")
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=args["timeout"]))
    rec = _instrument()
    results: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for repeat in range(args["repeats"]):
        for i, m in enumerate(ms):
            for impl in (("hand", "lightning") if (i + repeat) % 2 == 0 else ("lightning", "hand")):
                dist.barrier()
                run = _run_hand if impl == "hand" else _run_lightning
                results[(impl, m)].append(run(schedule, m, args, rec))
    return dict(results)


# --------------------------------------------------------------------------------------------------- the report
def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """One (impl, m): ``runs[repeat][rank]``. Steps after ``warmup`` of every repeat are pooled; step time = the
    slowest rank per step; everything else per rank, median over the pooled steps."""
    p = len(runs[0])
    steps = [step for run in runs for step in list(zip(*(o["steps"] for o in run)))[warmup:]]
    per_rank: list[dict[str, Any]] = []
    for rank in range(p):
        rank_steps = [step[rank] for step in steps]
        durations: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for s in rank_steps:
            for key, values in s["actions"].items():
                durations[key] += values
        per_rank.append({
            "sched": _median([s["sched"] for s in rank_steps]),
            "compute": _median([s["compute"] for s in rank_steps]),
            "compute_cpu": _median([s["compute_cpu"] for s in rank_steps]),
            "wait": _median([s["wait"] for s in rank_steps]),
            "issue": _median([s["issue"] for s in rank_steps]),
            "issue_cpu": _median([s["issue_cpu"] for s in rank_steps]),
            "rest": _median([s["sched"] - s["compute"] - s["wait"] - s["issue"] for s in rank_steps]),
            "bubble": _median([(s["sched"] - s["compute"]) / s["sched"] for s in rank_steps if s["sched"] > 0]),
            "wait_frac": _median([s["wait"] / s["sched"] for s in rank_steps if s["sched"] > 0]),
            "outside": _median([s["wall"] - s["sched"] for s in rank_steps]),
            "capture": _median([s["capture"] for s in rank_steps]),
            "publish": _median([s["publish"] for s in rank_steps]),
            # per (kind, stage): median wall and median thread CPU time of one action
            "costs": {key: _median([w for w, _ in values]) for key, values in durations.items()},
            "costs_cpu": {key: _median([c for _, c in values]) for key, values in durations.items()},
        })
    first = runs[0]
    curves = [[s["loss"] for s in o["steps"]] for o in first]
    loss_curve = next((curve for curve in reversed(curves) if all(v is not None for v in curve)), None)
    return {
        "wall": _median([max(s["wall"] for s in step) for step in steps]),
        "min": min(max(s["wall"] for s in step) for step in steps),
        "cpu": _median([statistics.mean(s["cpu"] for s in step) for step in steps]),
        "sched": _median([max(s["sched"] for s in step) for step in steps]),
        "n_steps": len(steps),
        "ranks": per_rank,
        "numel": [o["numel"] for o in first],
        "losses": loss_curve,
    }


def simulate_measured(analysis: dict[str, Any], costs: dict[tuple, float], p: int) -> Optional[float]:
    """Mean bubble of torch's table with each stage's measured F(+loss)/B/I/W durations."""
    def cost(action: Any) -> float:
        kind, stage = action.computation_type.value, action.stage_index
        value = costs.get((kind, stage))
        if value is None:
            raise KeyError((kind, stage))
        return value + (costs.get(("L", stage), 0.0) if kind == "F" else 0.0)

    try:
        bubbles, _ = simulate(analysis["tables"], p * analysis["v"], cost)
    except KeyError:
        return None
    return statistics.mean(bubbles)


def split_numel(args: dict[str, Any], schedule: str) -> tuple[int, int, int, list[int]]:
    """(total N, embeddings, norm+head, analytic numel per rank) for the split HybridStrategy uses."""
    from lightning_mgpu.demo import GPT, GPTConfig
    from lightning_mgpu.parallel.pipeline import plan_split, stage_indices, stages_per_rank

    with torch.device("meta"):
        gpt = GPT(GPTConfig(**_model_kwargs(args)))
    p = args["pp"]
    v = stages_per_rank(schedule, None)
    split = plan_split(gpt, p * v, "auto")
    size = lambda names: sum(q.numel() for n in names for q in gpt.get_submodule(n).parameters())  # noqa: E731
    blocks = [sum(q.numel() for q in block.parameters()) for block in gpt.transformer.h]
    per_rank = []
    for rank in range(p):
        numel = 0
        for s in stage_indices(schedule, rank, p, v):
            numel += sum(blocks[i] for i in split.blocks_of(s))
            numel += size(split.before) if s == 0 else 0
            numel += size(split.after) if s == p * v - 1 else 0
        per_rank.append(numel)
    total = sum(q.numel() for q in gpt.parameters())
    return total, size(split.before), size(split.after), per_rank


def _slash(values: list[float], fmt: str) -> str:
    return "/".join(format(v, fmt) for v in values)


def print_report(results: dict, analyses: dict, skipped: dict, args: dict[str, Any]) -> None:
    p = args["pp"]
    total, emb, head, _ = split_numel(args, "1F1B")
    print()
    print(
        f"GPT n_layer={args['n_layer']} n_embd={args['n_embd']} n_head={args['n_head']} block_size={args['block_size']}"
        f" batch={args['batch_size']}: N={total:,} params (embeddings {emb:,}, norm+head {head:,});"
        f" pp={p} ranks, gloo, 1 thread/rank, torch {torch.__version__}; steps {args['warmup'] + 1}..{args['steps']}"
        f" of {args['repeats']} run(s) per configuration timed. Load average (1 min) {args['load_before']:.1f} before,"
        f" {args['load_after']:.1f} after, on {os.cpu_count()} cores."
    )

    # ---- 1. bubble
    print("\n1. Bubble: idle fraction per rank inside schedule.step (r0/r1/...), mean over ranks where one number")
    head1 = (f"{'schedule':<21} {'m':>2} {'v':>1} | {'theory':>6} {'formula':<15} | {'sched':>5} {'x th':>5} |"
             f" {'sim-meas L/H':>12} | {'measured L':>{6 * p}} {'mean':>5} {'x th':>5} {'H mean':>6} | {'p2p wait L':>{6 * p}} |"
             f" {'act peak':>{5 * p}}")
    print(head1)
    print("-" * len(head1))
    for (schedule, m), a in analyses.items():
        sched = statistics.mean(a["sched"])
        ratio = sched / a["theory"]
        flag = " " if 1 / 1.2 <= ratio <= 1.2 else "!"
        r, rh = results.get((schedule, m, "lightning")), results.get((schedule, m, "hand"))
        if r is not None:
            sims = []
            for run in (r, rh):
                costs = {k: v for rank in run["ranks"] for k, v in rank["costs_cpu"].items()} if run else {}
                sim = simulate_measured(a, costs, p) if run else None
                sims.append("?" if sim is None else f"{sim:.3f}")
            measured = [rank["bubble"] for rank in r["ranks"]]
            mean = statistics.mean(measured)
            hand = f"{statistics.mean(rank['bubble'] for rank in rh['ranks']):.3f}" if rh is not None else "-"
            meas = (f"{'/'.join(sims):>12} | {_slash(measured, '.3f'):>{6 * p}} {mean:5.3f}"
                    f" {mean / a['theory']:5.2f} {hand:>6} |"
                    f" {_slash([rank['wait_frac'] for rank in r['ranks']], '.3f'):>{6 * p}}")
        else:
            meas = f"{'-':>12} | {'-':>{6 * p}} {'-':>5} {'-':>5} {'-':>6} | {'-':>{6 * p}}"
        print(f"{schedule:<21} {m:>2} {a['v']:>1} | {a['theory']:6.3f} {a['formula']:<15} | {sched:5.3f} {ratio:5.2f}{flag}|"
              f" {meas} | {_slash(a['act'], '.1f'):>{5 * p}}")
    for (schedule, m), a in analyses.items():
        for note in a["notes"]:
            print(f"  note {schedule} m={m}: {note}")
    for (schedule, m), reason in skipped.items():
        print(f"  skipped {schedule} m={m}: {reason}")

    # ---- 2. time
    print("\n2. Step time, HybridStrategy in Lightning (L) vs the same split by hand in a plain loop (H)")
    head2 = (f"{'schedule':<21} {'m':>2} | {'L ms':>6} {'H ms':>6} {'L/H':>5} | {'L min':>6} {'H min':>6} {'L/H':>5} |"
             f" {'L cpu':>6} {'H cpu':>6} {'L/H':>5} |"
             f" {'sched L':>7} {'sched H':>7} {'L/H':>5} | {'L out':>5} {'H out':>5} {'capt':>4} {'publ':>{5 * p}} |"
             f" {'-lit':>5} |"
             f" {'loss L':>6} {'H':>6} {'max|d|':>7}")
    framework = args.get("framework")
    loop_cost = framework["lightning_wall"] - framework["hand_wall"] if framework else 0.0
    if framework:
        print(f"   Lightning's own loop on one process, whole model, no pipelining: {framework['lightning_wall'] * 1e3:.1f}"
              f" ms per step vs {framework['hand_wall'] * 1e3:.1f} ms for a plain loop (CPU"
              f" {framework['lightning_cpu'] * 1e3:.1f} vs {framework['hand_cpu'] * 1e3:.1f}): {loop_cost * 1e3:.1f} ms"
              " per step that any Lightning run pays; column -lit = (L ms - that) / H ms.")
    print(head2)
    print("-" * len(head2))
    for (schedule, m) in analyses:
        rl, rh = results.get((schedule, m, "lightning")), results.get((schedule, m, "hand"))
        if rl is None or rh is None:
            print(f"{schedule:<21} {m:>2} | {'failed' if (schedule, m) not in skipped else 'skipped'}")
            continue
        mean_rank = lambda r, key: statistics.mean(x[key] for x in r["ranks"])  # noqa: E731
        diff = (max(abs(a - b) for a, b in zip(rl["losses"], rh["losses"]))
                if rl["losses"] and rh["losses"] else float("nan"))
        print(
            f"{schedule:<21} {m:>2} | {rl['wall'] * 1e3:6.1f} {rh['wall'] * 1e3:6.1f} {rl['wall'] / rh['wall']:5.2f} |"
            f" {rl['min'] * 1e3:6.1f} {rh['min'] * 1e3:6.1f} {rl['min'] / rh['min']:5.2f} |"
            f" {rl['cpu'] * 1e3:6.1f} {rh['cpu'] * 1e3:6.1f} {rl['cpu'] / rh['cpu']:5.2f} |"
            f" {rl['sched'] * 1e3:7.1f} {rh['sched'] * 1e3:7.1f} {rl['sched'] / rh['sched']:5.2f} |"
            f" {mean_rank(rl, 'outside') * 1e3:5.1f} {mean_rank(rh, 'outside') * 1e3:5.1f}"
            f" {mean_rank(rl, 'capture') * 1e3:4.1f} {_slash([x['publish'] * 1e3 for x in rl['ranks']], '4.1f'):>{5 * p}} |"
            f" {(rl['wall'] - loop_cost) / rh['wall']:5.2f} |"
            f" {rl['losses'][-1] if rl['losses'] else float('nan'):6.3f}"
            f" {rh['losses'][-1] if rh['losses'] else float('nan'):6.3f} {diff:7.1e}"
        )

    # ---- 2b. where the time goes
    print("\n   Inside schedule.step, ms per rank (r0/r1/...): compute (F+B+I+W+loss) wall and thread CPU time, p2p wait,")
    print("   p2p issue (torch's _batch_p2p: gloo isend/irecv) wall and thread CPU time, the rest (schedule Python,")
    print("   preemption); per-action thread CPU ms, per stage s: F(+loss) and B or I+W")
    head3 = (f"{'schedule':<21} {'m':>2} {'':>1} | {'compute':>{6 * p}} {'comp cpu':>{6 * p}} {'wait':>{6 * p}}"
             f" {'issue':>{6 * p}} {'iss cpu':>{6 * p}} {'rest':>{6 * p}} | per-action thread CPU ms")
    print(head3)
    print("-" * len(head3))
    for (schedule, m) in analyses:
        for impl in IMPLS:
            r = results.get((schedule, m, impl))
            if r is None:
                continue
            ranks = r["ranks"]
            costs = {k: v for rank in ranks for k, v in rank["costs_cpu"].items()}
            parts = []
            for s in sorted({k[1] for k in costs}):
                f = costs.get(("F", s), 0.0) + costs.get(("L", s), 0.0)
                back = (f"B{costs[('B', s)] * 1e3:.2f}" if ("B", s) in costs
                        else f"I{costs.get(('I', s), 0) * 1e3:.2f}+W{costs.get(('W', s), 0) * 1e3:.2f}")
                parts.append(f"s{s} F{f * 1e3:.2f} {back}")
            print(
                f"{schedule if impl == 'lightning' else '':<21} {m if impl == 'lightning' else '':>2} {impl[0].upper():>1} |"
                f" {_slash([x['compute'] * 1e3 for x in ranks], '5.1f'):>{6 * p}}"
                f" {_slash([x['compute_cpu'] * 1e3 for x in ranks], '5.1f'):>{6 * p}}"
                f" {_slash([x['wait'] * 1e3 for x in ranks], '5.1f'):>{6 * p}}"
                f" {_slash([x['issue'] * 1e3 for x in ranks], '5.1f'):>{6 * p}}"
                f" {_slash([x['issue_cpu'] * 1e3 for x in ranks], '5.1f'):>{6 * p}}"
                f" {_slash([x['rest'] * 1e3 for x in ranks], '5.1f'):>{6 * p}} |"
                f" {'; '.join(parts)}"
            )

    # ---- 3. memory
    print(f"\n3. Parameters held per rank (numel, r0/r1/...); N/pp = {total / p:,.0f}")
    head4 = (f"{'schedule':<21} | {'Lightning':>{9 * p}} {'hand':>{9 * p}} {'analytic':>{9 * p}} | {'max/(N/pp)':>10}"
             f" | analytic = blocks of the rank's stages + embeddings (stage 0) + norm/head (last stage)")
    print(head4)
    print("-" * len(head4))
    for schedule in dict.fromkeys(s for s, _ in analyses):
        _, _, _, analytic = split_numel(args, schedule)
        done = [(m, results.get((schedule, m, "lightning")), results.get((schedule, m, "hand")))
                for s, m in analyses if s == schedule]
        rl = next((x[1] for x in done if x[1] is not None), None)
        rh = next((x[2] for x in done if x[2] is not None), None)
        lnumel = _slash(rl["numel"], ",") if rl else "-"
        hnumel = _slash(rh["numel"], ",") if rh else "-"
        flag = "" if (rl is None or rl["numel"] == analytic) and (rh is None or rh["numel"] == analytic) else " !"
        print(f"{schedule:<21} | {lnumel:>{9 * p}} {hnumel:>{9 * p}} {_slash(analytic, ','):>{9 * p}} |"
              f" {max(analytic) / (total / p):10.2f}{flag}")

    print(
        f"""
Notes.
1. theory: closed form (p-1)/(m+p-1) (GPipe, 1F1B), (p-1)/(vm+p-1) (interleaved/looped, v stages per rank),
   (p-1)/(3vm+p-1) for zero-bubble schedules (only the first microbatch's forward ramp, F=1 of F+B=3, is idle).
   sched: event simulation of torch's schedule tables (pipeline_order; get_schedule_ops), F=1, B=2, I=W=1, free
   p2p, bubble 1 - busy/makespan; x th = sched/theory, '!' when outside 1/1.2..1.2.
   sim-meas: the same tables with the measured median F(+loss)/B/I/W of each stage (thread CPU time, so without
   preemption), of the Lightning run / of the hand run: the bubble this schedule order gives with this model's real
   per-stage costs (stage 0 has no input gradient, the last stage has the head and the loss) and free p2p.
   measured: per rank (time in schedule.step - compute) / time in schedule.step, median over timed steps, Lightning
   run; x th = mean/theory. p2p wait: share of schedule.step spent in torch's _wait_batch_p2p.
   act peak: most microbatch activations a rank holds at once per torch's table, in units of one rank's whole
   share of the model (a stage of v per rank counts 1/v), freed at B (or W).
2. L/H ms: median over timed steps of the slowest rank's step (optimizer step included); min: the fastest such step
   (least disturbed by other jobs); cpu: median of the ranks' mean process CPU time over the same span (gloo's
   threads included). sched: time in schedule.step (slowest rank). out: step - schedule.step (L: capture of the step
   per microbatch, broadcast of loss/logs, self.log, optimizer, Lightning's loop; H: zero_grad + AdamW), mean of the
   ranks. capt: the engine's capture of the step per microbatch (mean of the ranks); publ, per rank: its broadcast
   of the loss and logged values from the last stage (one small tensor once the logged names are known; it also
   waits for the last stage to finish), both within L out. -lit: L/H with Lightning's own per-step loop cost
   (measured first on one process without pipelining, printed above the table) taken out of L. loss: last step's loss, and the largest difference per step between the two runs
   (same seed, data and split).
   Per-action costs: medians over timed steps of F (forward_one_chunk, + the loss on the last stage), B
   (backward_one_chunk) or I/W (input/weight halves of a split backward). L forwards run the user's whole network
   call with interception (placeholders on meta, pass-through blocks) and replay the user's step as the loss.
3. Parameters as registered after training (Lightning: the LightningModule's, others' blocks are stand-ins);
   '!' when a measured count differs from the analytic one. V schedules put stage 0 and the last stage on rank 0."""
    )


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=str, default="",
                        help="comma-separated microbatch counts (default: 2*pp,4*pp)")
    parser.add_argument("--only", type=str, default="", help=f"comma-separated subset of {','.join(SCHEDULES)}")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (the first infers shapes)")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each (impl, m), interleaved in the same processes; timed steps pooled")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per schedule (all its runs)")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and torch's messages")
    ns = parser.parse_args(argv)
    args = vars(ns)
    p = ns.pp
    if p < 2 or not 0 <= ns.warmup < ns.steps or ns.repeats < 1:
        parser.error("need --pp >= 2, 0 <= --warmup < --steps and --repeats >= 1")
    ms = [int(x) for x in ns.microbatches.split(",") if x.strip()] or [2 * p, 4 * p]
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or list(SCHEDULES)
    unknown = set(names) - set(SCHEDULES)
    if unknown:
        parser.error(f"unknown schedules {sorted(unknown)}; choose from {list(SCHEDULES)}")

    # Import everything the ranks need before forking, so each job starts fast.
    import lightning  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    import lightning_mgpu  # noqa: F401
    import lightning_mgpu.demo  # noqa: F401

    analyses: dict[tuple[str, int], dict[str, Any]] = {}
    skipped: dict[tuple[str, int], str] = {}
    for name in names:
        for m in ms:
            if ns.batch_size % m:
                skipped[(name, m)] = f"batch {ns.batch_size} does not split into {m} microbatches"
                continue
            try:
                analyses[(name, m)] = analyze(name, p, m)
            except Exception as err:  # torch refuses this count (e.g. fewer microbatches than stages)
                skipped[(name, m)] = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
    dm = lightning_mgpu.demo.TextDataModule(batch_size=ns.batch_size, block_size=ns.block_size, val_fraction=0.1)
    dm.setup()
    if len(dm.train_dataset) < ns.steps * ns.batch_size:
        parser.error(f"{len(dm.train_dataset)} samples are fewer than --steps x --batch-size")

    results: dict[tuple[str, int, str], dict[str, Any]] = {}
    args["load_before"] = os.getloadavg()[0]
    start = time.perf_counter()
    args["framework"] = run_distributed(framework_job, 1, args, timeout=ns.timeout)[0]
    for name in names:
        valid = [m for m in ms if (name, m) in analyses]
        if not valid:
            continue
        t0 = time.perf_counter()
        outputs = run_or_report(name, schedule_job, p, name, valid, args, timeout=ns.timeout, verbose=ns.verbose)
        if outputs is None:
            continue
        line = []
        for m in valid:
            for impl in IMPLS:
                runs = [[o[(impl, m)][k] for o in outputs] for k in range(ns.repeats)]
                results[(name, m, impl)] = summarize(runs, ns.warmup)
            line.append(f"m={m} L {results[(name, m, 'lightning')]['wall'] * 1e3:.1f} / H"
                        f" {results[(name, m, 'hand')]['wall'] * 1e3:.1f} ms")
        print(f"{name}: {'; '.join(line)} ({time.perf_counter() - t0:.1f} s job)", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")
    args["load_after"] = os.getloadavg()[0]
    print_report(results, analyses, skipped, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
