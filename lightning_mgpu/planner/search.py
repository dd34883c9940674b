"""Enumerate the layouts a model can run with on a cluster, estimate each, and rank them by throughput."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from lightning_mgpu.layout import degree_splits, divisors
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import pipeline
from lightning_mgpu.planner.cluster import GB, ClusterSpec, Efficiency
from lightning_mgpu.planner.cost import Estimate, estimate
from lightning_mgpu.planner.job import CHECKPOINTING_ARGUMENTS, SCHEDULES, Layout, Microbatching, Training
from lightning_mgpu.planner.model_spec import ModelSpec
from lightning_mgpu.planner.recipe import refusal

_FIX_KEYS = {
    "tp": int,
    "pp": int,
    "dp": int,
    "zero": int,
    "zero_stage": int,
    "mbs": int,
    "microbatch_size": int,
    "schedule": str,
    "ckpt": str,
    "checkpointing": str,
    "sp": int,
    "hsdp": int,
    "dp_shard": int,
    "cp": int,
    "cp_mode": str,
    "ep": int,
}
# --fix's keys for the strategy's option names (sizes keep the mesh axes' names, as ``ParallelLayout.tp`` does)
_ALIASES = {
    "zero": "zero_stage",
    "mbs": "microbatch_size",
    "schedule": "pipeline_schedule",
    "ckpt": "activation_checkpointing",
    "checkpointing": "activation_checkpointing",
    "sp": "sequence_parallel",
    "hsdp": "dp_shard",
    "cp_mode": "context_parallel_mode",
}


@dataclass
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    training: Training
    efficiency: Efficiency
    ranked: list[Estimate]  # feasible, best first
    infeasible: list[Estimate] = field(default_factory=list)  # best-throughput ones that do not fit, with reasons
    rejected: list[str] = field(default_factory=list)  # fixed choices that are invalid, with reasons
    smallest: Estimate | None = None  # the layout needing the least memory, when none fits

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def parse_fix(text: str | None) -> dict[str, object]:
    """``tp=8,pp=64,ckpt=full`` to ``{"tp": 8, "pp": 64, "activation_checkpointing": "full"}``: the sizes by their
    mesh axes, the options by the strategy's names and values (``ckpt=none``: ``False``)."""
    fixed: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or key not in _FIX_KEYS:
            raise ValueError(f"--fix {item!r}: expected key=value with key in {', '.join(sorted(_FIX_KEYS))}.")
        try:
            converted = _FIX_KEYS[key](value.strip())
        except ValueError:
            raise ValueError(f"--fix {item!r}: {value!r} is not a valid {_FIX_KEYS[key].__name__}.") from None
        name = _ALIASES.get(key, key)
        fixed[name] = bool(converted) if name == "sequence_parallel" else converted
    if "activation_checkpointing" in fixed:
        ckpt = fixed["activation_checkpointing"]
        if ckpt not in CHECKPOINTING_ARGUMENTS:
            raise ValueError(f"--fix ckpt={ckpt}: choose one of {', '.join(CHECKPOINTING_ARGUMENTS)}.")
        fixed["activation_checkpointing"] = CHECKPOINTING_ARGUMENTS[str(ckpt)]
    if "pipeline_schedule" in fixed and fixed["pipeline_schedule"] not in SCHEDULES + ("none",):
        raise ValueError(f"--fix schedule={fixed['pipeline_schedule']}: choose one of {', '.join(SCHEDULES)}.")
    if "zero_stage" in fixed and fixed["zero_stage"] not in (0, 1, 2, 3):
        raise ValueError(f"--fix zero={fixed['zero_stage']}: ZeRO stages are 0, 1, 2, 3.")
    if "context_parallel_mode" in fixed and fixed["context_parallel_mode"] not in ("ring", "alltoall"):
        raise ValueError(f"--fix cp_mode={fixed['context_parallel_mode']}: choose ring or alltoall.")
    if "ep" in fixed and int(fixed["ep"]) < 1:  # type: ignore[call-overload]
        raise ValueError(f"--fix ep={fixed['ep']}: the expert-parallel size must be a positive integer.")
    if "dp_shard" in fixed and int(fixed["dp_shard"]) < 1:  # type: ignore[call-overload]
        raise ValueError(f"--fix hsdp={fixed['dp_shard']}: the shard group size must be a positive integer.")
    return fixed


def _structural_problem(
    model: ModelSpec, cluster: ClusterSpec, training: Training, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1
) -> str | None:
    """What the strategy refuses about these sizes for the model, whatever the other choices: its own message."""
    probe = Layout.of(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, options=_PROBE if pp > 1 else ParallelOptions())
    return refusal(model, probe, training)


_PROBE = ParallelOptions(pipeline_schedule="GPipe")  # a pipeline any number of microbatches runs


def _fixed_ep(fixed: dict[str, object]) -> int:
    """Expert parallelism is planned where it is asked for (``--fix ep=``), never searched."""
    ep = fixed.get("ep", 1)
    return ep if isinstance(ep, int) else 1


# The names `fixed` holds (what `parse_fix` gives): sizes by mesh axis, options by the strategy's names.
FIXED_NAMES = frozenset(_ALIASES.get(key, key) for key in _FIX_KEYS)


def _check_fixed_names(fixed: dict[str, object]) -> None:
    unknown = sorted(set(fixed) - FIXED_NAMES)
    if unknown:
        raise ValueError(
            f"Unknown fixed choices {unknown}: name sizes by mesh axis and options by HybridStrategy's names, one of"
            f" {sorted(FIXED_NAMES)} (as `parse_fix` gives them from --fix keys)."
        )


def candidates(
    model: ModelSpec, cluster: ClusterSpec, training: Training, fixed: dict[str, object] | None = None
) -> Iterator[Layout | str]:
    """Every layout worth estimating; a string says why a fixed choice cannot run at all."""
    fixed = fixed or {}
    _check_fixed_names(fixed)
    n = cluster.gpus
    degrees = {k: int(v) for k, v in fixed.items() if k in ("tp", "pp", "dp", "cp")}  # type: ignore[call-overload]
    complete = "dp" in degrees and len(degrees.keys() & {"tp", "pp", "dp"}) == 3 and "cp" in degrees
    if n % math.prod(degrees.values()) or (complete and math.prod(degrees.values()) != n):
        fixed_text = " x ".join(f"{k}={v}" for k, v in degrees.items())
        yield f"{fixed_text} does not match the {n} GPUs: the product must divide {n} (and equal it with dp fixed)"
        return
    for cp in _context_sizes(model, n, fixed):
        for dp, tp, pp in degree_splits(n, cp):
            if any(axis in fixed and fixed[axis] != size for axis, size in (("tp", tp), ("pp", pp), ("dp", dp))):
                continue
            problem = _structural_problem(model, cluster, training, tp, pp, dp, cp, _fixed_ep(fixed))
            if problem:
                if fixed.keys() & {"tp", "pp", "dp", "cp", "ep"}:
                    yield f"tp={tp} pp={pp} dp={dp}{f' cp={cp}' if cp > 1 else ''}: {problem}"
                continue
            yield from _variants(model, training, tp, pp, dp, fixed, cluster.gpus_per_node, cp)


LONG_SEQUENCE = 8192  # below this many tokens the search does not split sequences unless asked (--fix cp=)


def _context_sizes(model: ModelSpec, gpus: int, fixed: dict[str, object]) -> list[int]:
    """Context-parallel sizes worth trying: 1, and for long sequences the powers of two up to 16 that divide the
    GPUs (activation memory falls by cp, the ring's traffic hides behind attention)."""
    if "cp" in fixed:
        return [int(fixed["cp"])]  # type: ignore[call-overload]
    if model.seq_len < LONG_SEQUENCE or _fixed_ep(fixed) > 1:
        return [1]
    return [cp for cp in (1, 2, 4, 8, 16) if gpus % cp == 0]


def _variants(
    model: ModelSpec,
    training: Training,
    tp: int,
    pp: int,
    dp: int,
    fixed: dict[str, object],
    gpus_per_node: int = 8,
    cp: int = 1,
) -> Iterator[Layout | str]:
    """The planner's choices for one split (microbatching, schedule, ZeRO stage, checkpointing, HSDP), each layout
    checked by the strategy's own checks: one it refuses is left out, or, where the user fixed a choice, reported
    with the strategy's message."""
    per_rank = training.global_batch // dp
    mbs_fixed = fixed.get("microbatch_size")
    if isinstance(mbs_fixed, int) and per_rank % mbs_fixed:
        yield f"mbs={mbs_fixed} does not divide the {per_rank} sequences per data-parallel rank at dp={dp}"
        return
    ep = _fixed_ep(fixed)
    context_mode = ParallelOptions.context_parallel_mode  # the default, which the strategy requires at cp=1
    if cp > 1:
        context_mode = str(fixed.get("context_parallel_mode", context_mode))
    # Sequence parallelism where tensor parallelism is (less activation memory), else without it where the strategy
    # refuses it for this model (a vocabulary tp does not divide: the sequence-parallel plan shards the embedding).
    if "sequence_parallel" in fixed:
        sequence_parallel = [bool(fixed["sequence_parallel"]) and tp > 1]
    else:
        sequence_parallel = [True, False] if tp > 1 and ep == 1 else [False]
    for mbs in divisors(per_rank):
        if mbs > 64 or fixed.get("microbatch_size", mbs) != mbs:
            continue
        m = per_rank // mbs
        for schedule in _schedules(model, pp, fixed):
            for zero in _zero_stages(dp, pp, fixed):
                for ckpt, mode in CHECKPOINTING_ARGUMENTS.items():
                    if fixed.get("activation_checkpointing", mode) != mode:
                        continue
                    if ckpt != "none" and ep > 1 and not model.fused_experts:
                        if "activation_checkpointing" in fixed:  # a block with a list of experts runs twice under ep
                            yield f"ckpt={ckpt}: blocks with a list of experts are not checkpointed under ep={ep}"
                        continue
                    if ckpt == "selective" and training.flash_attention and "activation_checkpointing" not in fixed:
                        continue  # flash attention keeps no scores: selective recomputation would change nothing
                    for shard in _shard_sizes(dp, tp, zero, gpus_per_node, fixed) if cp == 1 else [None]:
                        problems = []
                        for sp in sequence_parallel:  # the first the strategy runs
                            options = ParallelOptions(
                                pipeline_schedule=schedule,
                                num_microbatches=m if pp > 1 else None,
                                activation_checkpointing=mode,
                                sequence_parallel=sp,
                                context_parallel_mode=context_mode,
                            )
                            layout = Layout.of(
                                tp=tp,
                                pp=pp,
                                dp=dp,
                                cp=cp,
                                ep=ep,
                                zero_stage=zero,
                                dp_shard=shard,
                                options=options,
                                microbatching=Microbatching(mbs, m),
                            )
                            problem = refusal(model, layout, training)
                            if problem is None:
                                yield layout
                                break
                            problems.append(f"{layout.describe()}: {problem}")
                        else:
                            if fixed:
                                yield problems[0]


def _schedules(model: ModelSpec, pp: int, fixed: dict[str, object]) -> tuple[str, ...]:
    """The pipeline schedules worth ranking: every one the runtime has whose stages cut the blocks evenly (the
    cost model assumes stages of equal blocks); without a pipeline the default, which the strategy requires there
    (``--fix schedule=none``: no pipeline)."""
    wanted = fixed.get("pipeline_schedule")
    if pp == 1:
        return (ParallelOptions.pipeline_schedule,) if wanted in (None, "none") else ()
    schedules = []
    for schedule in SCHEDULES:
        per_rank = pipeline.stages_per_rank(schedule, None)
        if wanted in (None, schedule) and (per_rank == 1 or model.layers % (per_rank * pp) == 0):
            schedules.append(schedule)
    return tuple(schedules)


def _zero_stages(dp: int, pp: int, fixed: dict[str, object]) -> tuple[int, ...]:
    """The ZeRO stages worth ranking: a fixed one always (at dp=1 the strategy runs it as stage 0, and warns);
    otherwise 0 alone at dp=1, and no sharded parameters under a pipeline (they would be regathered per
    microbatch)."""
    if "zero_stage" in fixed:
        return (int(fixed["zero_stage"]),)  # type: ignore[call-overload]
    if dp == 1:
        return (0,)
    return (0, 1) if pp > 1 else (0, 1, 2, 3)


def _shard_sizes(dp: int, tp: int, zero: int, gpus_per_node: int, fixed: dict[str, object]) -> list[int | None]:
    """ZeRO over all of dp (None) and, where dp leaves a node at ZeRO 2-3, hybrid sharding inside each node (HSDP:
    the shard groups' collectives on the node's links, only the shards' all-reduce across nodes)."""
    if "dp_shard" in fixed:
        shard = int(fixed["dp_shard"])  # type: ignore[call-overload]
        return [None if shard == dp else shard]  # what the strategy refuses (a non-divisor, ZeRO 0) it says
    sizes: list[int | None] = [None]
    if _fixed_ep(fixed) > 1:
        return sizes  # expert parallelism already splits dp in two: the strategy refuses HSDP beside it
    node_shard = gpus_per_node // tp if gpus_per_node % tp == 0 else 0
    if zero >= 2 and 1 < node_shard < dp and dp % node_shard == 0:
        sizes.append(node_shard)
    return sizes


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: Training,
    efficiency: Efficiency | None = None,
    fixed: dict[str, object] | None = None,
    scaling: bool = True,
) -> Plan:
    """Estimate every candidate; rank those that fit by tokens/s (ties: less memory)."""
    efficiency = efficiency or Efficiency()
    feasible: list[Estimate] = []
    infeasible: list[Estimate] = []
    rejected: list[str] = []
    for candidate in candidates(model, cluster, training, fixed):
        if isinstance(candidate, str):
            rejected.append(candidate)
            continue
        result = estimate(model, cluster, training, candidate, efficiency)
        (feasible if result.fits else infeasible).append(result)
    key = lambda e: (-e.tokens_per_s, e.memory["total"])
    feasible.sort(key=key)
    infeasible.sort(key=key)
    plan = Plan(
        model,
        cluster,
        training,
        efficiency,
        _distinct(feasible),
        _distinct(infeasible)[:5],
        rejected,
        min(infeasible, key=lambda e: e.memory["total"]) if infeasible and not feasible else None,
    )
    if scaling and plan.ranked:
        reference = _one_node_reference(model, cluster, training, efficiency)
        for result in plan.ranked[:50]:
            result.scaling_efficiency = result.tokens_per_s / result.layout.world_size / reference
    return plan


def _distinct(results: list[Estimate]) -> list[Estimate]:
    """Keep the best variant per (tp, pp, dp, zero, checkpointing), so the table shows different layouts."""
    seen: set[tuple] = set()
    kept = []
    for result in results:
        lay = result.layout
        key = (lay.tp, lay.pp, lay.dp, lay.cp, lay.zero_stage, lay.recomputation, lay.shard)
        if key not in seen:
            seen.add(key)
            kept.append(result)
    return kept


def reference_tokens_per_gpu(
    model: ModelSpec, cluster: ClusterSpec, training: Training, efficiency: Efficiency, gpus: int
) -> float:
    """Tokens/s per GPU of the best layout on ``gpus`` GPUs with the same batch per GPU. When nothing fits there,
    memory limits are ignored: a model too large for one node still gets the speed one node would reach."""
    small = replace(cluster, gpus=gpus)
    batch = max(1, training.global_batch * gpus // cluster.gpus)
    for bounded in (small, replace(small, memory_gb=1e9)):
        plan = search(model, bounded, replace(training, global_batch=batch), efficiency, scaling=False)
        if plan.ranked:
            return plan.ranked[0].tokens_per_s / gpus
    return float("nan")


def _one_node_reference(model: ModelSpec, cluster: ClusterSpec, training: Training, efficiency: Efficiency) -> float:
    return reference_tokens_per_gpu(model, cluster, training, efficiency, min(cluster.gpus, cluster.gpus_per_node))


def explain(plan: Plan) -> str:
    """One sentence on why the top layout wins."""
    best = plan.best
    if best is None:
        if plan.infeasible:
            return f"No layout fits: {plan.infeasible[0].layout.describe()} {plan.infeasible[0].problems[0]}."
        if plan.rejected:
            return "No layout is valid: HybridStrategy refuses every layout --fix asks for (why: below, or --json)"
        return "No layout is valid: no candidate matches --fix"
    lay = best.layout
    runner = next((e for e in plan.ranked[1:] if (e.layout.tp, e.layout.pp) != (lay.tp, lay.pp)), None)
    time = best.time
    losses = {k: v for k, v in time.items() if k not in ("compute", "step")}
    worst = max(losses, key=losses.get) if losses else "none"  # type: ignore[arg-type]
    within = "inside a node" if lay.tp <= plan.cluster.gpus_per_node else "across nodes"
    text = (
        f"{lay.describe()} wins with {best.tokens_per_s:,.0f} tokens/s: tensor parallelism stays {within},"
        f" compute is {time['compute'] / time['step']:.0%} of the step (largest overhead: {worst.replace('_', ' ')}"
        f" {losses.get(worst, 0) / time['step']:.0%}), and it fits in {best.memory['total'] / GB:.1f} GB"
    )
    if runner is not None:
        text += (
            f"; the best layout with other tp/pp ({runner.layout.describe()}) is"
            f" {1 - runner.tokens_per_s / best.tokens_per_s:.0%} slower"
        )
    return text + "."


def check_fit_hint(plan: Plan) -> str:
    if plan.smallest is None:
        return ""
    need = plan.smallest.memory["total"] / GB
    return (
        f" The smallest footprint is {need:.1f} GB per GPU ({plan.smallest.layout.describe()}): about"
        f" {math.ceil(plan.cluster.gpus * need / (plan.cluster.usable_bytes / GB))} GPUs would hold it."
    )
