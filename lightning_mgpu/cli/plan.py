"""``lightning-mgpu plan``: flags to a model, a cluster and a training setup; a ranked table (or JSON) out."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from lightning_mgpu.cli.errors import UsageError, positive_float, positive_int
from lightning_mgpu.planner import recipe
from lightning_mgpu.planner.cluster import GB, PRESETS, ClusterSpec, Efficiency, preset
from lightning_mgpu.planner.cost import Estimate
from lightning_mgpu.planner.job import PRECISIONS, SCHEDULES, Training
from lightning_mgpu.planner.model_spec import ModelSpec, spec_from_path
from lightning_mgpu.planner.search import Plan, check_fit_hint, explain, parse_fix, search
from lightning_mgpu.rehearsal import run_rehearsal

# flag: help
_MODEL_FLAGS = {
    "layers": "transformer blocks",
    "hidden": "hidden size (a multiple of --heads)",
    "heads": "attention (query) heads",
    "kv_heads": "key/value heads of grouped-query attention (unset: --heads)",
    "ffn_hidden": "MLP inner size, of each expert in a mixture of experts (unset: 4 x --hidden)",
    "vocab": "vocabulary size",
    "seq_len": "tokens per sequence",
    "experts": "routed experts per block of a mixture of experts (unset: a dense MLP)",
    "experts_per_token": "experts each token is routed to (with --experts; unset: 1)",
}


def add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    plan.description = (
        "Rank the layouts (tp, pp, dp, ZeRO stage, schedule, microbatches, activation checkpointing) of a transformer"
        " on a cluster by predicted throughput, with memory per GPU, step time, TFLOP/s per GPU, MFU, pipeline"
        " bubble and scaling efficiency against one node; every layout is checked by HybridStrategy's own checks"
        " (a layout it would refuse is not ranked), and the best is printed as the HybridStrategy(...) call and"
        " the LightningCLI YAML to paste. Nothing runs on GPUs: it is an analytic model (see"
        " lightning_mgpu.planner.cost). Bandwidths are GB/s per GPU in one direction."
    )
    model = plan.add_argument_group("model (a module, or its shapes)")
    model.add_argument("--module", help="pkg.mod:Class, built on the meta device (no memory) to read its shapes")
    model.add_argument("--init-args", help="JSON keyword arguments for --module's class")
    for name, text in _MODEL_FLAGS.items():
        model.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None, help=text)
    model.add_argument("--gated-mlp", action="store_true", help="SwiGLU-style MLP (three matrices)")
    model.add_argument("--tied-embeddings", action="store_true", help="the output head is the token embedding")
    model.add_argument(
        "--attention",
        choices=("flash", "eager"),
        default="flash",
        help="eager keeps the seq x seq attention scores for backward",
    )
    cluster = plan.add_argument_group("cluster")
    cluster.add_argument("--gpu", default="h100-sxm", help=f"preset: {', '.join(PRESETS)}")
    cluster.add_argument("--gpus", type=positive_int, default=None, help="total GPUs (unset: one node)")
    cluster.add_argument("--gpus-per-node", type=positive_int, default=None, help="overrides the preset's (8 mostly)")
    for name, text in (
        ("gpu_memory_gb", "memory per GPU, GB"),
        ("peak_tflops", "dense 16-bit peak per GPU, TFLOP/s"),
        ("intra_node_gbps", "bandwidth between the GPUs of a node, GB/s"),
        ("inter_node_gbps", "network bandwidth per GPU, GB/s"),
        ("hbm_gbps", "memory bandwidth per GPU, GB/s"),
    ):
        cluster.add_argument(
            f"--{name.replace('_', '-')}", type=positive_float, default=None, help=f"{text} (overrides the preset)"
        )
    training = plan.add_argument_group("training")
    training.add_argument(
        "--global-batch", type=positive_int, default=None, help="sequences per optimizer step (unset: 4 per GPU)"
    )
    training.add_argument("--precision", default="bf16-mixed", choices=tuple(PRECISIONS), help="the Trainer's")
    out = plan.add_argument_group("output")
    out.add_argument(
        "--fix",
        default=None,
        help="evaluate given choices only, e.g. tp=8,pp=4,schedule=ZBVZeroBubble"
        f" (keys: tp pp dp cp cp_mode ep zero hsdp schedule mbs ckpt sp; schedules: {', '.join(SCHEDULES)})",
    )
    out.add_argument(
        "--rehearse",
        action="store_true",
        help="play the --fix layout's ranks with the library's real setup on this machine (meta tensors, torch's"
        " fake process group at --gpus ranks): per rank parameter/gradient/optimizer bytes and stage blocks, beside"
        " the planner; a layout the real job would refuse fails here with the same message",
    )
    out.add_argument(
        "--pretrained",
        metavar="PATH",
        help="with --rehearse: the weights the job starts from (as HybridStrategy(pretrained=PATH)); checks every"
        " checkpoint entry's name and shape against the module and each rank's slices against the layout, from the"
        " checkpoint's headers only, and reports the bytes each rank reads",
    )
    out.add_argument(
        "--pretrained-strict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --pretrained: refuse entries either side lacks (--no-pretrained-strict: a new head is fine)",
    )
    out.add_argument("--top", type=positive_int, default=10, help="rows in the table")
    out.add_argument("--json", action="store_true", help="print the plan as JSON (HybridStrategy's argument names)")
    out.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's FLOP/s and bandwidths first"
        " with a few steps of the model (CPU processes here) and use them instead of the defaults",
    )
    plan.set_defaults(run=run_plan)


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    shapes = {name: getattr(args, name) for name in _MODEL_FLAGS if name not in ("experts", "experts_per_token")}
    if args.module:
        if args.experts:
            raise UsageError("--experts describes a model given by its shapes; --module's are read from the module.")
        return spec_from_path(args.module, args.init_args, **shapes)
    required = ("layers", "hidden", "heads", "vocab", "seq_len")
    missing = [f"--{n.replace('_', '-')}" for n in required if shapes[n] is None]
    if missing:
        raise UsageError(f"Describe the model with --module pkg.mod:Class, or give {' '.join(missing)}.")
    if args.experts_per_token and not args.experts:
        raise UsageError(f"--experts-per-token {args.experts_per_token} needs --experts (the experts to route to).")
    if args.experts_per_token and args.experts_per_token > args.experts:
        raise UsageError(f"--experts-per-token {args.experts_per_token} exceeds the --experts {args.experts}.")
    spec = ModelSpec(
        gated_mlp=args.gated_mlp,
        tied_embeddings=args.tied_embeddings,
        name="flags",
        **{k: v for k, v in shapes.items() if v is not None},
    )
    if not args.experts:
        return spec
    one_expert = (3 if spec.gated_mlp else 2) * spec.hidden * spec.ffn
    return replace(
        spec,
        experts=args.experts,
        experts_per_token=args.experts_per_token or 1,
        expert_params=args.experts * one_expert,
    )


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    overrides = {
        "gpus_per_node": args.gpus_per_node,
        "memory_gb": args.gpu_memory_gb,
        "peak_tflops": args.peak_tflops,
        "intra_node_gbps": args.intra_node_gbps,
        "inter_node_gbps": args.inter_node_gbps,
        "hbm_gbps": args.hbm_gbps,
    }
    return preset(args.gpu, gpus=args.gpus, **overrides)


def run_plan(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    cluster = cluster_from_args(args)
    fixed = parse_fix(args.fix)
    training = Training(
        global_batch=args.global_batch or 4 * cluster.gpus,
        precision=args.precision,
        flash_attention=args.attention == "flash",
    )
    cluster.check_precision(training.precision)
    if args.rehearse:
        return run_rehearsal(args, model, cluster, training, fixed)
    efficiency = Efficiency()
    if args.calibrate:
        from lightning_mgpu.planner.calibrate import calibrate

        cluster, efficiency = calibrate(args, cluster, model)
    plan = search(model, cluster, training, efficiency, fixed)
    if args.json:
        print(json.dumps(plan_as_dict(plan, args.top), indent=2))
    else:
        print(format_plan(plan, args.top))
    return 0 if plan.ranked else 2


def _recipe(plan: Plan) -> dict[str, Any] | None:
    """The best layout as what to write: HybridStrategy's and the Trainer's arguments, the DataLoader's batch size,
    the call and the LightningCLI block, and what the strategy would warn."""
    if plan.best is None:
        return None
    layout = plan.best.layout
    return {
        "strategy": recipe.strategy_kwargs(layout, plan.training),
        "trainer": recipe.trainer_kwargs(layout, plan.cluster, plan.training),
        "batch_size": layout.loader_batch_size,
        "python": recipe.python_recipe(layout, plan.cluster, plan.training),
        "yaml": recipe.cli_yaml(layout, plan.cluster, plan.training),
        "warnings": recipe.warnings_for(layout, plan.cluster),
    }


def plan_as_dict(plan: Plan, top: int) -> dict[str, Any]:
    return {
        "model": {
            **{k: getattr(plan.model, k) for k in ("name", "layers", "hidden", "heads", "vocab", "seq_len")},
            "kv_heads": plan.model.num_kv_heads,
            "ffn_hidden": plan.model.ffn,
            "params": plan.model.total_params,
        },
        "cluster": plan.cluster.__dict__,
        "training": plan.training.__dict__,
        "efficiency": plan.efficiency.__dict__,
        "best": _recipe(plan),
        "ranked": [e.as_dict() for e in plan.ranked[:top]],
        "infeasible": [e.as_dict() for e in plan.infeasible],
        "rejected": plan.rejected,
        "why": explain(plan),
    }


def _row(rank: str, e: Estimate) -> str:
    lay = e.layout
    schedule = lay.options.pipeline_schedule if lay.pp > 1 else "-"
    scaling = "-" if e.scaling_efficiency != e.scaling_efficiency else f"{e.scaling_efficiency:.0%}"
    return (
        f"{rank:>4} {lay.tp:>3} {lay.pp:>3} {lay.dp:>4} {lay.cp:>3} {lay.zero_stage:>4} {schedule:<15}"
        f" {lay.microbatching.size:>4} {lay.microbatching.count:>5} {lay.recomputation:<9}"
        f" {e.memory['total'] / GB:>7.1f} {e.time['step']:>8.3f}"
        f" {e.tokens_per_s:>11,.0f} {e.tflops_per_gpu:>7.1f} {e.mfu:>5.0%} {e.bubble:>6.1%} {scaling:>6}"
    )


def format_plan(plan: Plan, top: int = 10) -> str:
    lines = [
        plan.model.describe(),
        plan.cluster.describe(),
        f"global batch {plan.training.global_batch} x {plan.model.seq_len} tokens, {plan.training.precision},"
        f" {'flash' if plan.training.flash_attention else 'eager'} attention;"
        f" efficiencies: {plan.efficiency.source}",
        "",
    ]
    header = (
        f"{'rank':>4} {'tp':>3} {'pp':>3} {'dp':>4} {'cp':>3} {'zero':>4} {'schedule':<15} {'mbs':>4} {'n_mb':>5}"
        f" {'ckpt':<9} {'GB/GPU':>7} {'step s':>8} {'tokens/s':>11} {'TFLOP/s':>7} {'MFU':>5} {'bubble':>6}"
        f" {'scale':>6}"
    )
    lines += [header, "-" * len(header)]
    lines += [_row(str(i + 1), e) for i, e in enumerate(plan.ranked[:top])]
    if not plan.ranked:
        lines.append("  (no layout fits)")
    lines += ["", "Why: " + explain(plan) + check_fit_hint(plan)]
    if plan.infeasible:
        lines.append("Faster layouts that do not fit:")
        lines += [f"  {e.layout.describe()}: {e.problems[0]}" for e in plan.infeasible[:3]]
    refused = sorted(set(plan.rejected))
    if plan.ranked and refused:
        lines.append(
            f"{len(refused)} layouts matching --fix were left out: HybridStrategy refuses them (--json lists why)."
        )
    elif refused:
        lines.append("HybridStrategy refuses the layouts --fix asks for:")
        lines += [f"  {reason}" for reason in refused[:8]] + (
            [f"  ... and {len(refused) - 8} more"] if len(refused) > 8 else []
        )
    best = _recipe(plan)
    if best is not None:
        lines += ["", "The best layout, as HybridStrategy arguments (every setting the prediction assumes):", ""]
        lines += ["```python", best["python"], "```", "", "LightningCLI:", "", "```yaml", best["yaml"], "```"]
        lines += [f"The strategy warns: {warning}" for warning in best["warnings"]]
    lines += [
        "",
        "TFLOP/s per GPU counts recomputation, as Megatron-LM's Table 1 does; MFU does not. scale: tokens/s"
        " per GPU against the best layout on one node with the same batch per GPU.",
    ]
    return "\n".join(lines)
