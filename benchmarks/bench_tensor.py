"""Benchmark tensor parallelism: HybridStrategy against the same plan by hand and Lightning's ModelParallelStrategy.

Each run trains the demo GPT (``lightning_mgpu.demo``, nanoGPT with a fused ``c_attn``) in its own ``--tp`` forked
gloo processes with the same init, batches (Lightning's order) and plan, through ``benchmarks/run.py``:

================  ==============================================================================================
``hybrid``        (a) ``Trainer`` + ``HybridStrategy(tensor_parallel_size=tp, data_parallel_size=1)``, auto plan
``by-hand``       (b) a plain loop (the demo module's loss and AdamW groups): the auto plan written out per block
                  for torch's ``parallelize_module`` with ``lightning_mgpu.parallel.tensor.style(...)`` objects, so
                  identical to (a)'s; head counts, SP replication, the gradient-layout hook, ``implicit_replication``
                  by hand (``parallelize_by_hand``)
``lightning-mp``  (c) ``Trainer`` + ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=tp)``,
                  ``parallelize_by_hand`` in ``configure_model``
``empty-*``       an empty step (one scalar parameter, the demo's ``self.log(..., sync_dist=True)``, AdamW) in a
                  plain loop and under Lightning's single-device strategy, ``DDPStrategy``,
                  ``ModelParallelStrategy`` and ``HybridStrategy`` (no-op ``tp_plan``): Lightning's own per-step cost
``llama``         a tiny Hugging Face Llama (``tests/helpers/modules.LlamaModule``) under ``HybridStrategy``
================  ==============================================================================================

Printed: step, CPU and iteration times (start to next start) with the ratios to (b), phases, memory per rank, last
loss and sharding (placements and local shapes, read at ``--mem-step``) against (a)'s; the empty-step
table and where (a) - (b) goes; the collectives of one untimed step (``collectives.comm_recorder``) per block,
outside the blocks and in the optimizer step beside the Megatron-LM expectation (``analytic_comm``), cross-checked
against the gloo work items the profiler saw, and (b)'s and (c)'s against (a)'s; ``--profile``: op counts of (a) and
(b). ``python -m benchmarks.bench_tensor --help`` lists the flags.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter, defaultdict
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from benchmarks import by_hand, collectives, demo_gpt
from benchmarks.probes import make_step_probe, memory_per_rank, profiled_collectives, sharding
from benchmarks.report import MB, ratio_table
from benchmarks.run import SEED, fit, load_average, quiet_fds, run_interleaved, start_rank
from benchmarks.stats import summarize
from benchmarks.timing import LoopTimer

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
TIMEOUT = timedelta(seconds=120)


# ------------------------------------------------------------------------------------------------ in the ranks
def _empty_module() -> Any:
    import lightning as L

    class EmptyStep(L.LightningModule):
        """One scalar parameter: a step is the loop's own work (hooks, closure, logging with sync, optimizer)."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def configure_model(self) -> None:
            pass  # ModelParallelStrategy insists on an override

        def _loss(self, batch: Any) -> torch.Tensor:
            return self.w.square()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self._loss(batch)
            self.log("train_loss", loss, prog_bar=True, sync_dist=True)  # as the demo module does
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([self.w], lr=3e-4)

    return EmptyStep()


def _module_and_data(name: str, args: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    from lightning_mgpu.demo import GPTLightningModule

    if name == "llama":
        from tests.helpers.modules import LlamaModule, RandomTokenDataModule

        module = LlamaModule(num_key_value_heads=max(2, args["tp"]), seed=SEED)
        c = module.model.config
        dims = dict(b=args["batch_size"], s=32, h=c.hidden_size, V=c.vocab_size, L=c.num_hidden_layers, max_pos=0)
        dims["qkv_bias"] = False
        return module, RandomTokenDataModule(batch_size=args["batch_size"], seq_len=32), dims
    if name.startswith("empty"):
        return _empty_module(), demo_gpt.demo_data(args), {}
    if name == "hybrid":
        return GPTLightningModule(**demo_gpt.gpt_kwargs(args)), demo_gpt.demo_data(args), {}
    module = by_hand.by_hand_module(demo_gpt.gpt_kwargs(args), args["sequence_parallel"], args["mp_rehook"])
    return module, demo_gpt.demo_data(args), {}


def _strategy(name: str, args: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from lightning_mgpu import HybridStrategy

    sizes = dict(tensor_parallel_size=args["tp"], data_parallel_size=1, timeout=TIMEOUT)
    if name in ("hybrid", "llama"):
        return HybridStrategy(**sizes, sequence_parallel=args["sequence_parallel"], loss_parallel=args["loss_parallel"])
    if name == "empty-hybrid":
        return HybridStrategy(**sizes, tp_plan=lambda module, mesh: None)
    if name in ("lightning-mp", "empty-mp"):
        return ModelParallelStrategy(**sizes)
    if name == "empty-ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=TIMEOUT)
    return SingleDeviceStrategy(device=torch.device("cpu"))


def _found_blocks(module: nn.Module) -> str | None:
    from lightning_mgpu.parallel.blocks import find_block_container

    found = find_block_container(module)
    return found[0] if found else None


def fit_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """One Trainer fit of run ``name`` in this rank: timed steps, then the profiled step, then the recorded one."""
    start_rank(args["verbose"])
    steps = args["steps_for"][name]
    module, datamodule, dims = _module_and_data(name, args)
    recorder = {steps + 1: lambda trainer: collectives.comm_recorder(trainer.world_size)}
    probe = make_step_probe(args["mem_step"], steps, args["verbose"], probes=recorder, ops=args["profile"])
    devices, strategy = 1 if name == "empty-single" else args["tp"], _strategy(name, args)
    result = fit(probe, module, datamodule, devices=devices, strategy=strategy, max_steps=steps + 2)
    return {**result, "records": result["probes"].get(steps + 1), "blocks": _found_blocks(module), "dims": dims}


def loop_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The plain loop, timed like the Trainer's steps: ``by-hand`` (the demo GPT, plan by hand) or ``empty-loop``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mgpu.demo import GPTLightningModule

    start_rank(args["verbose"])
    dist.init_process_group("gloo", timeout=TIMEOUT)
    tp, steps, sp = args["tp"], args["steps_for"][name], args["sequence_parallel"] and name == "by-hand"
    module = _empty_module() if name == "empty-loop" else GPTLightningModule(**demo_gpt.gpt_kwargs(args))
    if name == "by-hand":
        by_hand.parallelize_by_hand(module.model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), sp)
    optimizer = module.configure_optimizers()
    data = demo_gpt.demo_data(args)
    data.setup()
    batches = demo_gpt.lightning_order(data.train_dataset, args["batch_size"], replicas=1, rank=0)  # one dp replica
    profiled = profiled_collectives(tp, args["verbose"], args["profile"])
    probes = {steps: profiled, steps + 1: collectives.comm_recorder(tp)}
    timer, memory, layout, loss = LoopTimer(), None, None, torch.tensor(float("nan"))
    for step, batch in zip(range(steps + 2), batches):
        with timer.step(probe=probes.get(step)):
            with by_hand.step_context(sp):
                loss = module._loss(batch)
            optimizer.zero_grad(set_to_none=True)
            timer.mark("backward")
            with by_hand.step_context(sp):
                loss.backward()
            timer.mark("optimizer")
            if step == args["mem_step"]:
                memory, layout = memory_per_rank(module, [optimizer]), sharding(module)
            optimizer.step()
    result = {**timer.result(), "memory": memory, "sharding": layout, "comm": profiled.result, "dims": {}}
    return {**result, "records": probes[steps + 1].result, "blocks": _found_blocks(module), "loss": float(loss)}


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
    b, s, h, V = d["b"], d["s"], d["h"], d["V"]
    X = 4 * b * s * h
    out: dict[tuple[str, str], Counter] = defaultdict(Counter)

    def add(region: str, phase: str, kind: str, n: int, nbytes: int) -> None:
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


# ------------------------------------------------------------------------------------------------ the report
def print_timing(res: dict[str, dict[str, Any]], args: dict[str, Any]) -> None:
    print(
        f"\nms: median over steps {args['warmup'] + 1}..{args['steps']} of {args['repeats']} run(s), slowest rank"
        f" (cpu: mean of the {args['tp']} ranks' process CPU time); iter: batch start to next batch start"
    )
    head = (
        f"{'run':<40} {'step':>6} {'(min)':>6} {'cpu':>6} {'iter':>6} {'cpu':>6} | {'fwd/bwd/opt wall':>16} |"
        f" {'param':>5} {'grad':>5} {'optim':>5} MB | {'loss':>6} sharding"
    )
    print(head + "\n" + "-" * len(head))
    ref = res.get("hybrid", {}).get("rank0", {}).get("sharding")
    for name in [n for n in MAIN if n in res]:
        r, mine = res[name], res[name]["rank0"]["sharding"]
        mem = r["memory"]
        mem_s = " ".join(f"{mem[k] / MB:5.2f}" for k in ("params", "grads", "optim")) if mem else f"{'?':>17}"
        same = "" if ref is None else "= (a)" if mine == ref else "DIFFERS from (a)"
        print(
            f"{MAIN[name]:<40} "
            + " ".join(f"{r[k] * 1e3:6.1f}" for k in ("median", "min", "cpu", "iter", "iter_cpu"))
            + f" | {'/'.join(f'{x * 1e3:.0f}' for x in r['phases'][:3]):>16} | {mem_s} | {r['loss']:6.4f} {same}"
        )
        if ref is not None and mine != ref:
            print(f"    first differences (a) vs this: {[(x, y) for x, y in zip(ref, mine) if x != y][:3]}")
    pairs = [(n, "by-hand", 1.05 if n == "hybrid" else None) for n in ("hybrid", "lightning-mp")]
    ratio_table(res, pairs, title="\nratios to (b), median over repeats [min-max]")
    ratio_table(res, pairs, span="iter")
    empties = [n for n in EMPTY if n in res]
    if empties:
        print(
            f"\nEmpty training step (1 scalar parameter, self.log(sync_dist=True), AdamW), {args['tp']} processes"
            f" unless noted: the loop's own per-step cost, ms\n{'run':<40} {'step':>6} {'cpu':>6} {'iter':>6}"
            f" {'cpu':>6}"
        )
        for n in empties:
            print(
                f"{EMPTY[n]:<40} " + " ".join(f"{res[n][k] * 1e3:6.2f}" for k in ("median", "cpu", "iter", "iter_cpu"))
            )
    differences = [
        ("hybrid", "by-hand", "(a) - (b)"),
        ("lightning-mp", "by-hand", "(c) - (b)"),
        ("empty-mp", "empty-loop", "Lightning loop, empty step (MP - loop)"),
        ("empty-ddp", "empty-loop", "Lightning loop, empty step (DDP - loop)"),
        ("empty-single", "empty-loop", "Lightning loop, empty step (1 device - loop)"),
        ("empty-hybrid", "empty-mp", "HybridStrategy over ModelParallelStrategy, empty"),
    ]
    if "hybrid" in res and "by-hand" in res:
        print("\nWhere (a) - (b) goes, ms per step (wall / cpu):")
        for x, y, label in [d for d in differences if d[0] in res and d[1] in res]:
            dx = {k: (res[x][k] - res[y][k]) * 1e3 for k in ("median", "cpu", "iter", "iter_cpu")}
            print(
                f"  {label:<48} {dx['median']:+7.2f} / {dx['cpu']:+6.2f}   per iteration {dx['iter']:+7.2f} /"
                f" {dx['iter_cpu']:+6.2f}"
            )


def print_comm(res: dict[str, dict[str, Any]], args: dict[str, Any]) -> None:
    tp, sp, lp = args["tp"], args["sequence_parallel"], args["loss_parallel"]
    print(
        f"\nCollectives per training step, tp={tp}{' + sequence parallel' if sp else ''}"
        f"{' + loss parallel' if lp else ''}: torch CommDebugMode on rank 0 over one untimed step. N KIND bytes:"
        f" count, bytes of the full tensors; ring: bytes each rank sends (AR 2(tp-1)/tp, AG/RS (tp-1)/tp)."
    )
    gpt = {
        "b": args["batch_size"],
        "s": args["block_size"],
        "h": args["n_embd"],
        "V": 256,
        "L": args["n_layer"],
        "qkv_bias": True,
        "max_pos": args["block_size"],
    }
    regs = {
        n: collectives.regions(r["rank0"]["records"], r["rank0"]["blocks"])
        for n, r in res.items()
        if r["rank0"].get("records") is not None
    }
    for name, model, title in (
        ("hybrid", "gpt", "demo GPT, (a) HybridStrategy"),
        ("llama", "llama", "tiny HF Llama, HybridStrategy"),
    ):
        if name not in regs:
            continue
        r, d = res[name], gpt if model == "gpt" else res[name]["rank0"]["dims"]
        expected = analytic_comm(model, d, tp, sp, lp)
        print(
            f"\n{title}: b={d['b']} s={d['s']} h={d['h']} V={d['V']} layers={d['L']};"
            f" X = 4*b*s*h = {collectives.fmt_bytes(4 * d['b'] * d['s'] * d['h'])}"
        )
        measured = collectives.print_against(regs[name], expected, d["L"], tp, "analytic (Megatron)")
        if r.get("comm"):
            rs = measured.get("RSB", 0) * (tp - 1) / tp  # gloo runs a reduce-scatter as an all-reduce
            print(
                "  cross-check, gloo work items of the step before (profiler):"
                f" {collectives.fmt_bytes(r['comm']['bytes'])}"
                " ring-equivalent"
                + (
                    f" (expected ring + {collectives.fmt_bytes(rs)} ="
                    f" {collectives.fmt_bytes(collectives.ring(measured, tp) + rs)})"
                    if rs
                    else ""
                )
            )
        opt, ana_opt = regs[name].get(("optimizer", "opt")), expected.get(("optimizer", "opt"))
        if opt and ana_opt and opt.get("AR") and ana_opt.get("AR"):
            print(
                f"  optimizer step: {opt['AR']} AR for {ana_opt['AR']} parameters with Partial(sum) gradients"
                f" ({opt['AR'] / ana_opt['AR']:.1f} each): DTensor redistributes such a gradient on every use."
            )
        mem = r.get("memory")
        if mem and mem["grads"] > mem["params"] * 1.001:
            print(
                f"  gradients hold {collectives.fmt_bytes(mem['grads'] - mem['params'])} more than the parameters"
                " per rank: a sharded parameter got a replicated (full-size) gradient."
            )
    others = {MAIN[n]: regs[n] for n in ("by-hand", "lightning-mp") if n in regs}
    if others and "hybrid" in regs:
        print("\nThe same step's collectives in the other runs against (a)'s (reference; logging left out):")
        if MAIN["lightning-mp"] in collectives.print_same_as(regs["hybrid"], others, tp) and not args["mp_rehook"]:
            print(
                "    (ModelParallelStrategy.setup() calls module.to() after configure_model, which drops the"
                " parameters' gradient-layout hooks: the fused q|k|v bias gradient stays _StridedShard and AdamW"
                " gathers it on each use; --mp-rehook re-arms them)"
            )


NOTES = """
Notes. step: on_train_batch_start -> on_train_batch_end (the loop times the same work: forward, loss, zero_grad,
  backward, optimizer step); iter: batch start to next batch start (adds data loading and Lightning's work between
  steps); cpu: process CPU time. fwd/bwd/opt: wall ms of forward+zero_grad / backward / optimizer step.
  param/grad/optim: local MB per rank after backward of step --mem-step. loss: rank 0's last (same batches in the
  same order: (a), (b), (c) agree to float noise). (a) and (c) log train_loss with sync_dist each step, (b) does not:
  the empty step measures that kind of per-step cost without a model.
collectives: '!' marks a row that differs from the analytic (Megatron-LM) expectation (analytic_comm's docstring).
  Counted from on_train_batch_start to on_train_batch_end: Lightning's once-per-step SIGTERM flag broadcast falls
  outside (in 'iter', not in 'step')."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = processes per run")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism in (a), (b) and (c)")
    parser.add_argument(
        "--loss-parallel",
        action="store_true",
        help="loss_parallel=True in (a) and the Llama run ((b) and (c) keep gathering the logits)",
    )
    demo_gpt.add_run_args(parser, repeats=2, batch_help="per rank (every rank of a tp group reads the same)")
    parser.add_argument("--empty-steps", type=int, default=40, help="timed steps of the empty-step runs")
    parser.add_argument("--mem-step", type=int, default=2, help="optimizer step at which memory is read")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ORDER)}")
    parser.add_argument("--no-empty", action="store_true", help="skip the empty-step baselines")
    parser.add_argument("--no-llama", action="store_true", help="skip the tiny HF Llama collectives run")
    parser.add_argument(
        "--mp-rehook",
        action="store_true",
        help="(c): re-arm the gradient-layout hooks that ModelParallelStrategy's module.to() drops",
    )
    parser.add_argument("--profile", action="store_true", help="torch.profiler op counts of (a) and (b), one step")
    args = demo_gpt.parse_run_args(parser, argv)
    if args["tp"] < 2 or args["empty_steps"] <= args["warmup"]:
        parser.error("need --tp >= 2 and --empty-steps > --warmup")
    names = [
        n
        for n in demo_gpt.select(parser, args["only"], ORDER)
        if args["only"] or not ((args["no_empty"] and n in EMPTY) or (args["no_llama"] and n == "llama"))
    ]
    if "llama" in names and (4 % args["tp"] or args["tp"] > 4):
        print(f"note: the tiny Llama has 4 attention heads: no Llama run for tp={args['tp']}")
        names.remove("llama")
    args["steps_for"] = {
        n: args["empty_steps"] if n in EMPTY else args["warmup"] + 1 if n == "llama" else args["steps"] for n in ORDER
    }
    demo_gpt.preload()
    if "llama" in names:
        try:
            with quiet_fds(not args["verbose"]):  # torchao (pulled in by transformers) prints load failures
                demo_gpt.preload("transformers.models.llama.modeling_llama", "tests.helpers.modules")
        except ImportError:
            print("note: transformers is not importable: no Llama run")
            names.remove("llama")
    data = demo_gpt.demo_data(args)
    data.setup()
    if len(data.train_dataset) // args["batch_size"] < max(args["steps"], args["empty_steps"]) + 2:
        print("note: runs cross an epoch boundary (the plain loops stop at its end)")
    jobs = {
        n: (loop_job if n in LOOPS else fit_job, 1 if n == "empty-single" else args["tp"], (n, args)) for n in names
    }
    runs = run_interleaved(
        {n: j for n, j in jobs.items() if n != "llama"}, args["repeats"], args["timeout"], args["verbose"]
    )
    runs.update(run_interleaved({n: j for n, j in jobs.items() if n == "llama"}, 1, args["timeout"], args["verbose"]))
    res = {name: summarize(done, args["warmup"]) for name, done in runs.items()}
    print(
        f"\nGPT n_layer={args['n_layer']} n_embd={args['n_embd']} n_head={args['n_head']} block_size="
        f"{args['block_size']}, batch {args['batch_size']}; tp={args['tp']}"
        f"{' + sequence parallel' if args['sequence_parallel'] else ''}"
        f"{' + loss parallel in (a)' if args['loss_parallel'] else ''} over {args['tp']} gloo processes, 1 thread"
        f" each, torch {torch.__version__}, {os.cpu_count()} CPUs; load {load_average()}"
    )
    print_timing(res, args)
    print_comm(res, args)
    ops_a, ops_b = [(res.get(n, {}).get("comm") or {}).get("ops") for n in ("hybrid", "by-hand")]
    if args["profile"] and ops_a and ops_b:
        print("\ntorch.profiler, one untimed step on rank 0: ops whose count differs between (a) and (b)")
        collectives.print_op_diff(ops_a, ops_b, ("(a)", "(b)"))
    print(NOTES)
    return res


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
