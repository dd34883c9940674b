"""The planner: its formulas against the papers they come from, Megatron-LM's Table 1, the module reader and the
`lightning-mgpu plan` command."""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from dataclasses import replace

import lightning as L
import pytest

from lightning_mgpu.cli import main
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.pipeline import PIPELINE_SCHEDULES
from lightning_mgpu.planner import (
    ClusterSpec,
    Efficiency,
    Layout,
    Microbatching,
    ModelSpec,
    Training,
    build_on_meta,
    estimate,
    microbatching_for,
    preset,
    search,
)
from lightning_mgpu.planner.cost import (
    activation_bytes_per_layer,
    bubble_fraction,
    memory,
    paper_flops_per_step,
    step_time,
)
from lightning_mgpu.planner.job import SCHEDULES
from lightning_mgpu.planner.model_spec import spec_from_module
from lightning_mgpu.planner.search import candidates, parse_fix, reference_tokens_per_gpu

# Narayanan et al. (2021), Table 1: (params, hidden, heads, layers, GPUs, batch, tp, pp, published TFLOP/s per GPU).
TABLE_1 = [
    ("1.7B", 2304, 24, 24, 32, 512, 1, 1, 137),
    ("18.4B", 6144, 48, 40, 256, 1024, 8, 2, 135),
    ("145.6B", 12288, 96, 80, 1536, 2304, 8, 8, 148),
    ("1008B", 25600, 160, 128, 3072, 3072, 8, 64, 163),
]


def _megatron_gpt(hidden: int, heads: int, layers: int) -> ModelSpec:
    """The paper's GPT: vocabulary 51200, sequence 2048, learned positions, head tied to the embedding."""
    return ModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=51200,
        seq_len=2048,
        tied_embeddings=True,
        learned_positions=True,
        name="megatron-gpt",
    )


@pytest.mark.parametrize("row", TABLE_1, ids=[row[0] for row in TABLE_1])
def test_megatron_table_1(row):
    """`--fix` with the paper's (tp, pp) and full recomputation predicts the published TFLOP/s per GPU within 15%;
    the planner's own top choice is at least as fast, fits in 80 GB and keeps tensor parallelism inside a node."""
    name, hidden, heads, layers, gpus, batch, tp, pp, published = row
    model = _megatron_gpt(hidden, heads, layers)
    assert model.total_params / 1e9 == pytest.approx(float(name[:-1]), rel=0.03)
    cluster = preset("a100-80gb", gpus=gpus)
    assert (cluster.memory_gb, cluster.peak_tflops, cluster.gpus_per_node) == (80, 312, 8)
    training = Training(global_batch=batch, precision="bf16-mixed", flash_attention=False)  # 2021: no flash attention
    fixed = search(model, cluster, training, fixed=parse_fix(f"tp={tp},pp={pp},ckpt=full"), scaling=False).best
    assert fixed is not None and fixed.fits
    assert (fixed.layout.tp, fixed.layout.pp, fixed.layout.recomputation) == (tp, pp, "full")
    paper_flops = paper_flops_per_step(model, batch, "full")
    assert fixed.tflops_per_gpu == pytest.approx(paper_flops / fixed.time["step"] / gpus / 1e12)
    assert fixed.tflops_per_gpu == pytest.approx(published, rel=0.15), fixed.layout.describe()

    top = search(model, cluster, training, scaling=False).best
    assert top is not None
    # "As much" in the paper's own count: its FLOPs per step (with recomputation) over the top layout's step time.
    assert paper_flops / top.time["step"] / gpus / 1e12 >= fixed.tflops_per_gpu
    assert top.tokens_per_s >= fixed.tokens_per_s
    assert top.memory["total"] <= 80e9 and top.fits
    assert cluster.gpus_per_node % top.layout.tp == 0


def test_paper_flops_formula():
    """Our FLOP count reproduces Narayanan et al.'s closed form, 96 B s l h^2 (1 + s/6h + V/16lh)."""
    B, s, l, h, V = 512, 2048, 24, 2304, 51200  # noqa: E741 - the paper's names
    model = _megatron_gpt(h, 24, l)
    closed = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert paper_flops_per_step(model, B, "full") == pytest.approx(closed, rel=1e-12)
    without = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert paper_flops_per_step(model, B, "none") == pytest.approx(without)


@pytest.mark.parametrize("sp", [False, True])
def test_activation_memory_is_korthikanti(sp):
    """Korthikanti et al. (2022) Table 2, 16-bit activations, per layer and microbatch."""
    s, b, h, a, t = 2048, 2, 4096, 32, 8
    model = ModelSpec(layers=4, hidden=h, heads=a, vocab=1000, seq_len=s)
    eager = Training(global_batch=8, precision="bf16-mixed", flash_attention=False)
    layout = Layout.of(tp=t, options=ParallelOptions(sequence_parallel=sp), microbatching=Microbatching(size=b))
    got = {c: activation_bytes_per_layer(model, eager, layout, c) for c in ("none", "selective", "full")}
    if sp:
        assert got["none"] == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
        assert got["selective"] == pytest.approx(s * b * h * 34 / t)
        assert got["full"] == pytest.approx(2 * s * b * h / t)
    else:
        assert got["none"] == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        assert got["selective"] == pytest.approx(s * b * h * (10 + 24 / t))
        assert got["full"] == pytest.approx(2 * s * b * h)
    one = activation_bytes_per_layer(model, eager, Layout.of(microbatching=Microbatching(size=b)), "none")
    assert one == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def _pipelined(schedule: str) -> Layout:
    """pp=4, dp=2, 16 microbatches of one sequence under ``schedule``."""
    options = ParallelOptions(pipeline_schedule=schedule, num_microbatches=16)
    return Layout.of(pp=4, dp=2, options=options, microbatching=Microbatching(size=1, count=16))


def test_memory_by_zero_stage_and_schedule():
    """Mixed precision with Adam: 4 + 4 + 8 bytes per parameter, sharded over dp by stage; 1F1B holds pp
    microbatches on the first stage, GPipe all of them; interleaving shrinks the bubble."""
    model = ModelSpec(layers=8, hidden=1024, heads=16, vocab=32000, seq_len=1024)
    cluster, training = preset("h100-sxm", gpus=8), Training(global_batch=64)
    n = model.total_params
    for zero, (p, g, o) in {0: (4, 4, 8), 1: (4, 4, 8 / 4), 2: (1, 1, 2), 3: (1, 1, 2)}.items():
        with_sp = Layout.of(dp=4, tp=2, zero_stage=zero, options=ParallelOptions(sequence_parallel=True))
        mem = memory(model, cluster, training, with_sp)
        expected = (p * n / 2, g * n / 2, o * n / 2)  # norms stay whole under tp: 0.1% of the parameters
        assert (mem["params"], mem["grads"], mem["optimizer"]) == pytest.approx(expected, rel=2e-3)
    # Without sequence parallelism this library's plans keep the embedding and the head whole.
    whole = 2 * model.vocab * model.hidden
    mem = memory(model, cluster, training, Layout.of(dp=4, tp=2))
    assert mem["params"] == pytest.approx(4 * ((n - whole) / 2 + whole), rel=2e-3)
    small_vocab = ModelSpec(layers=8, hidden=1024, heads=16, vocab=1000, seq_len=1024)  # the first stage is fullest
    act = {s: memory(small_vocab, cluster, training, _pipelined(s))["activations"] for s in ("GPipe", "1F1B")}
    assert act["GPipe"] / act["1F1B"] == pytest.approx(16 / 4, rel=0.01)
    assert bubble_fraction(_pipelined("1F1B")) == pytest.approx(3 / 19)
    assert bubble_fraction(_pipelined("Interleaved1F1B")) == pytest.approx(1.5 / 17.5)
    assert set(SCHEDULES) <= set(PIPELINE_SCHEDULES)  # the planner's schedules are names the runtime runs


def test_spec_from_a_real_module_on_meta():
    """The demo GPT built on the meta device: shapes read from its config, parameter counts exact, no memory used."""
    from lightning_mgpu.demo import GPTLightningModule

    args = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    module = build_on_meta(GPTLightningModule, args)
    assert all(p.device.type == "meta" for p in module.parameters())
    spec = spec_from_module(module)
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq_len) == (12, 768, 12, 50304, 1024)
    assert spec.total_params == sum(p.numel() for p in module.parameters())
    one_layer = GPTLightningModule(**{**args, "n_layer": 1}).model.num_params()
    assert spec.total_params == one_layer + 11 * spec.params_per_layer


def test_scaling_efficiency_is_against_one_node():
    model = ModelSpec(layers=32, hidden=4096, heads=32, ffn_hidden=11008, gated_mlp=True, vocab=32000, seq_len=4096)
    node = search(model, preset("h100-sxm", gpus=8), Training(global_batch=32)).best
    assert node is not None and node.scaling_efficiency == pytest.approx(1.0)
    cluster, training = preset("h100-sxm", gpus=64), Training(global_batch=256)
    big = search(model, cluster, training).best
    reference = reference_tokens_per_gpu(model, cluster, training, Efficiency(), 8)
    assert big.scaling_efficiency == pytest.approx(big.tokens_per_s / 64 / reference)
    assert 0.5 < big.scaling_efficiency < 1.0  # crossing nodes costs something, and not everything


def test_plan_command_table_json_and_fix(capsys):
    flags = [
        "plan",
        "--layers",
        "24",
        "--hidden",
        "2048",
        "--heads",
        "16",
        "--vocab",
        "32000",
        "--seq-len",
        "2048",
        "--gpu",
        "a100-80gb",
        "--gpus",
        "16",
        "--global-batch",
        "64",
    ]
    assert main(flags + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "GB/GPU" in out and "Why: tp=" in out
    assert main(flags + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["ranked"][0]
    sizes = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    assert best["fits"] and math.prod(best["layout"][name] for name in sizes) == 16  # HybridStrategy's names
    arguments = {name: value for name, value in best["layout"].items() if name != "microbatch_size"}
    assert plan["best"]["strategy"] == arguments | {"global_batch_size": 64}  # the call printed for the winner
    assert {"params", "grads", "optimizer", "activations", "total"} <= best["memory"].keys()
    ranked = [r["tokens_per_s"] for r in plan["ranked"]]
    assert ranked == sorted(ranked, reverse=True)
    # A layout that does not fit says what does not fit.
    assert main(flags + ["--fix", "tp=1,pp=1,zero=0,mbs=4", "--gpu-memory-gb", "24"]) == 2
    out = capsys.readouterr().out
    assert "No layout fits: tp=1 pp=1 dp=16 zero=0" in out and "needs" in out and "GB per GPU" in out
    assert "activations" in out and "The smallest footprint is" in out
    assert main(flags + ["--fix", "tp=3"]) == 2
    assert "tp=3 does not match the 16 GPUs" in capsys.readouterr().out
    assert main(flags + ["--fix", "tp=2,pp=1,mbs=3"]) == 2
    assert "mbs=3 does not divide the 8 sequences per data-parallel rank at dp=8" in capsys.readouterr().out


def test_plan_command_reads_a_module(capsys):
    assert (
        main(
            [
                "plan",
                "--module",
                "lightning_mgpu.demo:GPTLightningModule",
                "--init-args",
                '{"n_layer": 6, "n_embd": 256, "n_head": 8}',
                "--gpus",
                "8",
                "--top",
                "2",
            ]
        )
        == 0
    )
    assert "GPTLightningModule:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "4"], "give --hidden --heads --vocab --seq-len"),
        (["--module", "lightning_mgpu.demo:Nope"], "has no attribute 'Nope'"),
        (
            ["--module", "lightning_mgpu.demo:GPTLightningModule", "--init-args", "{bad"],
            "--init-args is not valid JSON",
        ),
        (
            ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "9", "--seq-len", "8", "--gpu", "tpu"],
            "Unknown --gpu 'tpu'",
        ),
        (
            ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "9", "--seq-len", "8", "--fix", "tp"],
            "expected key=value",
        ),
        (
            ["--layers", "4", "--hidden", "64", "--heads", "5", "--vocab", "9", "--seq-len", "8"],
            "not divisible by heads",
        ),
    ],
)
def test_plan_command_bad_input(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ measured on this machine (CPU, gloo processes)
MEASURED_GPT = dict(block_size=32, n_layer=4, n_head=4, n_embd=64)
MEASURED_BATCH = 8
# (processes, HybridStrategy arguments): ZeRO 0-3, tensor and pipeline parallel, and mixes, at 2 and 4 processes.
MEASURED_LAYOUTS = [
    (2, {"zero_stage": 0}),
    (2, {"zero_stage": 2}),
    (2, {"zero_stage": 3}),
    (2, {"tensor_parallel_size": 2}),
    (2, {"pipeline_parallel_size": 2}),
    (4, {"zero_stage": 1}),
    (4, {"zero_stage": 3}),
    (4, {"tensor_parallel_size": 2, "zero_stage": 1}),
    (4, {"pipeline_parallel_size": 2, "zero_stage": 1}),
    (4, {"pipeline_parallel_size": 2, "num_microbatches": 4}),
]
MEASURED_STEPS, WARMUP_STEPS = 6, 2


class StepTimer(L.Callback):
    """Wall and CPU seconds of each training batch on this rank (``on_train_batch_start`` to ``_end``)."""

    def __init__(self) -> None:
        self.results: dict[str, list[float]] = {"step_wall": [], "step_cpu": []}

    def on_train_batch_start(self, *args: object) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, *args: object) -> None:
        self.results["step_wall"].append(time.perf_counter() - self._start[0])
        self.results["step_cpu"].append(time.process_time() - self._start[1])


def step_medians(extras: list[dict], warmup: int = WARMUP_STEPS) -> tuple[float, float]:
    """(wall, CPU) seconds of a step: the slowest rank's per step, median over the steps after the warm-up."""
    wall, cpu = ([max(ranks) for ranks in zip(*(e[key] for e in extras))][warmup:] for key in ("step_wall", "step_cpu"))
    return statistics.median(wall), statistics.median(cpu)


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two lists of distinct values."""

    def ranks(xs: list[float]) -> list[int]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        return [order.index(i) for i in range(len(xs))]

    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ranks(a), ranks(b))) / (n * (n * n - 1))


_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "zero_stage")


def planner_layout(processes: int, kwargs: dict) -> Layout:
    """The planner's candidate for ``HybridStrategy(**kwargs)`` on ``processes`` processes: the layout and options
    the strategy resolves, cut as the strategy cuts ``MEASURED_BATCH`` (``microbatching_for``)."""
    layout = ParallelLayout.resolve(processes, **{name: kwargs[name] for name in _SIZES if name in kwargs})
    options = ParallelOptions(**{name: value for name, value in kwargs.items() if name not in _SIZES})
    return Layout.from_strategy(layout, options, microbatching_for(layout, options, MEASURED_BATCH))


@pytest.fixture(scope="module")
def calibrated():
    """This machine measured as ``plan --calibrate`` does, for the demo GPT at the most processes used below."""
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule
    from lightning_mgpu.planner.calibrate import measure

    vocab = TextDataModule(batch_size=1, block_size=32).vocab_size
    module = GPTLightningModule(**MEASURED_GPT, vocab_size=vocab)
    spec = spec_from_module(module)
    return spec, measure(spec, module, processes=max(p for p, _ in MEASURED_LAYOUTS))


@pytest.fixture(scope="module")
def measured_runs(calibrated):  # calibrated first: the runs then find the machine as the calibration did
    """One fit per layout, memory probed after backward of step 1 (optimizer states exist by then), every step
    timed (``benchmarks/bench_planner.py`` does the same with more steps)."""
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule
    from tests.helpers.equivalence import fit
    from tests.helpers.probes import MemoryProbe

    runs = []
    for processes, kwargs in MEASURED_LAYOUTS:
        dp = processes // (kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1))
        _, extras = fit(
            lambda: GPTLightningModule(**MEASURED_GPT),
            lambda dp=dp: TextDataModule(batch_size=MEASURED_BATCH // dp, block_size=MEASURED_GPT["block_size"]),
            kwargs,
            processes,
            MEASURED_STEPS,
            callbacks_factory=lambda: [MemoryProbe(step=1), StepTimer()],
        )
        runs.append((processes, kwargs, extras))
    return runs


@pytest.mark.slow  # the slow tier: measures training runs of several layouts
def test_predicted_memory_matches_measured(measured_runs):
    """Parameters + gradients + optimizer states per rank (the fullest rank), predicted within 10%."""
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    vocab = TextDataModule(batch_size=1, block_size=32).vocab_size
    spec = spec_from_module(build_on_meta(GPTLightningModule, {**MEASURED_GPT, "vocab_size": vocab}))
    cluster, training = preset("a100-80gb", gpus=8), Training(global_batch=MEASURED_BATCH, precision="32-true")
    rows = []
    for processes, kwargs, extras in measured_runs:
        measured = max(e["param_bytes"] + e["grad_bytes"] + e["optim_bytes"] for e in extras)
        predicted = memory(spec, cluster, training, planner_layout(processes, kwargs))
        predicted_static = predicted["params"] + predicted["grads"] + predicted["optimizer"]
        rows.append((processes, kwargs, measured, predicted_static))
    report = "\n".join(
        f"{p} processes {k}: measured {m / 1e3:.1f} kB, predicted {q / 1e3:.1f} kB ({q / m - 1:+.1%})"
        for p, k, m, q in rows
    )
    print(report)
    for _, _, measured, predicted in rows:
        assert predicted == pytest.approx(measured, rel=0.10), report


@pytest.mark.slow  # the slow tier: measures training runs of several layouts
def test_predicted_step_time_ranks_the_layouts_as_measured(calibrated, measured_runs):
    """The calibrated cost model orders the layouts' step times as measured (Spearman >= 0.8): the slowest rank's
    time per step, median over the steps after the warm-up, on 2 and 4 processes sharing this machine.

    CPU time (each process's own work) against the predicted work per process is checked always. Wall time against
    the full prediction (the work slowed down by processes sharing the cores) is checked where other jobs left the
    cores to this one when it was calibrated: with more busy cores than the machine has, wall time orders the
    scheduler's choices more than the layouts (measured at a load of 40 on 2 cores: Spearman 0.75 to 0.92).
    """
    spec, machine = calibrated
    training = Training(global_batch=MEASURED_BATCH, precision="32-true")
    rows = []
    for processes, kwargs, extras in measured_runs:
        cluster, efficiency = machine.as_cluster(processes)
        predicted = estimate(spec, cluster, training, planner_layout(processes, kwargs), efficiency).time["step"]
        rows.append((processes, kwargs, *step_medians(extras), predicted, predicted / cluster.contention))
    rho = spearman([r[4] for r in rows], [r[2] for r in rows])
    rho_cpu = spearman([r[5] for r in rows], [r[3] for r in rows])
    report = "\n".join(
        f"{p} processes {k}: measured {w * 1e3:.1f} ms (CPU {c * 1e3:.1f}), predicted {q * 1e3:.1f}"
        f" ms (CPU {qc * 1e3:.1f})"
        for p, k, w, c, q, qc in rows
    )
    report += (
        f"\nSpearman {rho:.2f} (CPU time against the predicted work per process: {rho_cpu:.2f});"
        f" {machine.as_cluster(4)[1].source}"
    )
    print(report)
    assert rho_cpu >= 0.8, report
    if machine.busy <= machine.cores:
        assert rho >= 0.8, report


def test_calibration_shares_cores_between_processes():
    from lightning_mgpu.planner.calibrate import Measurements

    machine = Measurements(
        flops=2e10, memory_bw=1e10, latency=1e-4, bus_bw=1e9, memory_gb=16, cores=2, layer_overhead=1e-3
    )
    one, eff_one = machine.as_cluster(2)
    four, eff_four = machine.as_cluster(4)
    assert one.peak_tflops == four.peak_tflops == pytest.approx(0.02)  # per process on a core of its own
    assert (one.contention, four.contention) == (1.0, 2.0)
    busy = Measurements(flops=2e10, memory_bw=1e10, latency=1e-4, bus_bw=1e9, memory_gb=16, cores=2, busy=2.0)
    assert busy.as_cluster(2)[0].contention == 2.0 and busy.as_cluster(4)[0].contention == 3.0
    assert eff_four.latency_s == eff_one.latency_s == pytest.approx(1e-4)
    assert eff_one.gemm == 1.0 and eff_one.memory_passes == 0.0 and eff_one.layer_overhead_s == 1e-3
    # Every part of a step runs ``contention`` times slower: the same layout at 4 processes takes twice as long.
    model = ModelSpec(layers=2, hidden=64, heads=4, vocab=100, seq_len=32)
    training, layout = Training(global_batch=8, precision="32-true"), Layout.of(tp=2, dp=1, pp=1)
    base = estimate(model, one, training, layout, eff_one).time
    slow = estimate(model, replace(one, gpus=4, gpus_per_node=4), training, layout, eff_one).time
    assert slow["step"] == pytest.approx(2 * base["step"])
    assert base["compute"] >= (model.layers + 1) * 1e-3  # dispatch per block and microbatch, head included


def test_plan_calibrate_measures_this_machine(capsys):
    assert (
        main(
            [
                "plan",
                "--module",
                "lightning_mgpu.demo:GPTLightningModule",
                "--init-args",
                json.dumps(MEASURED_GPT),
                "--calibrate",
                "--gpus",
                "2",
                "--global-batch",
                "8",
                "--precision",
                "32-true",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["cluster"]["name"] == "this-machine" and plan["cluster"]["gpus"] == 2
    assert plan["efficiency"]["source"].startswith("calibrated here")
    assert 1e-6 < plan["cluster"]["peak_tflops"] < 10  # a CPU core: GFLOP/s, not a GPU's TFLOP/s


def test_choose_layout_for_a_real_module_keeps_fixed_sizes():
    """What `"auto"` sizes ask: the fastest fitting layout for the module on this job's devices, fixed sizes kept."""
    from lightning_mgpu.demo import GPTLightningModule
    from lightning_mgpu.planner.auto import choose_layout, local_cluster

    module = build_on_meta(GPTLightningModule, {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 32})
    cluster = local_cluster(world_size=4, devices_per_node=4)
    best = choose_layout(module, cluster, global_batch=8, precision="32-true", fixed={"tp": 2})
    assert best.fits and best.layout.tp == 2 and best.layout.world_size == 4
    assert 8 % best.layout.dp == 0 and 4 % best.layout.pp == 0
    tiny = ClusterSpec(
        gpus=4, gpus_per_node=4, memory_gb=1e-4, peak_tflops=1, intra_node_gbps=1, inter_node_gbps=1, reserved_gb=0
    )
    with pytest.raises(ValueError, match=r"found no layout .* needs .* GB per GPU"):
        choose_layout(module, tiny, global_batch=8)


def test_hybrid_sharding_divides_memory_by_the_shard_group_and_keeps_gathers_on_a_node():
    """HSDP (``dp_shard``): ZeRO's bytes per rank divide by the shard group, not dp; the gathers run on the node's
    links, so on several nodes ZeRO-3 with shard groups of a node spends less time communicating than over all dp;
    the search offers it where dp leaves a node, and ``--fix hsdp=`` pins it."""
    from lightning_mgpu.planner.cost import data_parallel_bytes, step_time

    model = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq_len=4096)
    cluster, training = preset("h100-sxm", gpus=32), Training(global_batch=64)
    n = model.total_params
    full = memory(model, cluster, training, Layout.of(dp=32, zero_stage=3))
    hybrid = memory(model, cluster, training, Layout.of(dp=32, zero_stage=3, dp_shard=8))
    assert hybrid["optimizer"] == pytest.approx(8 * n / 8, rel=1e-3) and full["optimizer"] == pytest.approx(8 * n / 32)
    assert hybrid["params"] == pytest.approx(4 * full["params"], rel=1e-6)
    eff = Efficiency()
    two = Microbatching(count=2)
    over_nodes = step_time(model, cluster, training, Layout.of(dp=32, zero_stage=3, microbatching=two), eff)
    in_node = step_time(model, cluster, training, Layout.of(dp=32, zero_stage=3, microbatching=two, dp_shard=8), eff)
    assert in_node["zero3_gather"] < over_nodes["zero3_gather"]
    assert Layout.of(dp=32, zero_stage=3, dp_shard=8).describe().endswith("hsdp=8 mbs=1x1 ckpt=none")
    plan = search(model, cluster, training, eff, fixed=parse_fix("zero=3,hsdp=8,tp=1,pp=1"), scaling=False)
    assert plan.ranked and all(e.layout.shard == 8 and e.layout.replicas == 4 for e in plan.ranked)
    offered = search(model, cluster, training, eff, fixed=parse_fix("zero=3,tp=1,pp=1"), scaling=False)
    assert {e.layout.shard for e in offered.ranked + offered.infeasible} >= {8, 32}
    # The analytic bytes per group: an all-reduce of the shards across 4 groups, gathers and reduce-scatters in one.
    sent = data_parallel_bytes(n, 3, dp=32, shard=8, gathered=2 * n)
    assert sent["replicas"] == pytest.approx(2 * 3 / 4 * 4 * n / 8)
    assert sent["shard"] == pytest.approx(7 / 8 * 4 * (n + 2 * n)) and sent["dp"] == 0
    assert data_parallel_bytes(n, 0, dp=32) == {"shard": 0.0, "replicas": 0.0, "dp": 2 * 31 / 32 * 4 * n}


def test_the_auto_route_estimates_the_strategy_layout_with_its_shard_groups():
    """``"auto"`` sizes estimate the strategy's whole ``ParallelLayout`` with its options: a candidate with
    ``data_parallel_shard_size`` is the search's HSDP layout (same memory), not ZeRO over all of dp."""
    from lightning_mgpu.demo import GPTLightningModule
    from lightning_mgpu.planner.auto import plan_strategy_layout

    module = build_on_meta(GPTLightningModule, {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 32})
    spec, cluster, eff = spec_from_module(module), preset("h100-sxm", gpus=8), Efficiency()
    hsdp = ParallelLayout(data_parallel_size=8, zero_stage=3, data_parallel_shard_size=4)
    planned = plan_strategy_layout(module, [hsdp], cluster, 2, "32-true", ParallelOptions(), eff).estimate
    assert planned is not None and planned.layout.shard == 4
    training = Training(global_batch=2 * 8, precision="32-true")
    fix = parse_fix("zero=3,hsdp=4,tp=1,pp=1,mbs=2,ckpt=none")
    searched = next(c for c in candidates(spec, cluster, training, fix) if not isinstance(c, str))
    assert planned.memory == memory(spec, cluster, training, searched)
    assert planned.memory != memory(spec, cluster, training, replace(searched, data_parallel_shard_size=None))


def test_fixed_choices_under_names_the_search_does_not_know_are_refused_by_name():
    """``fixed`` holds sizes by mesh axis and options by the strategy's names (``parse_fix``'s output); a name of the
    planner's old vocabulary (``schedule``, ``checkpointing``) is refused, not silently ignored."""
    from lightning_mgpu.demo import GPTLightningModule

    module = build_on_meta(GPTLightningModule, {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 32})
    spec, cluster = spec_from_module(module), preset("h100-sxm", gpus=8)
    for old in ({"schedule": "GPipe"}, {"checkpointing": "full"}, {"cp_mode": "ring"}):
        with pytest.raises(ValueError, match=rf"Unknown fixed choices \['{next(iter(old))}'\].*pipeline_schedule"):
            list(candidates(spec, cluster, Training(global_batch=16), old))
    assert any(not isinstance(c, str) for c in candidates(spec, cluster, Training(16), parse_fix("schedule=GPipe")))


def test_context_parallelism_divides_activations_and_wins_for_long_sequences(capsys):
    """A 7B Llama at 131072 tokens on 8 H100s: activation memory per GPU falls by cp; with data parallelism only
    (tp=1, pp=1) no layout without cp fits and a cp layout does; left free, the search ranks a cp layout first
    (its ring traffic hides behind attention, where tensor parallelism's all-reduces do not)."""
    model = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq_len=131072, gated_mlp=True, ffn_hidden=11008)
    cluster, training = preset("h100-sxm", gpus=8), Training(global_batch=8)
    full = ParallelOptions(activation_checkpointing="full")
    one = memory(model, cluster, training, Layout.of(dp=8, zero_stage=3, options=full))
    four = memory(model, cluster, training, Layout.of(dp=2, cp=4, zero_stage=3, options=full))
    assert four["activations"] == pytest.approx(one["activations"] / 4, rel=1e-6)
    assert four["optimizer"] == pytest.approx(one["optimizer"], rel=1e-6)  # ZeRO shards over dp x cp = 8 either way
    only_dp = search(model, cluster, training, fixed=parse_fix("tp=1,pp=1"), scaling=False)
    assert only_dp.ranked and all(e.layout.cp > 1 for e in only_dp.ranked)
    assert not search(model, cluster, training, fixed=parse_fix("tp=1,pp=1,cp=1"), scaling=False).ranked
    free = search(model, cluster, training, scaling=False)
    assert free.best is not None and free.best.layout.cp > 1, free.best
    assert (
        main(
            [
                "plan",
                "--layers",
                "32",
                "--hidden",
                "4096",
                "--heads",
                "32",
                "--vocab",
                "32000",
                "--seq-len",
                "131072",
                "--gated-mlp",
                "--ffn-hidden",
                "11008",
                "--global-batch",
                "8",
                "--fix",
                "tp=1,pp=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert " cp " in out.splitlines()[4]  # the table's cp column
    winner = re.search(r"^Why: (.*?) wins", out, re.MULTILINE)
    assert winner and int(re.search(r"\bcp=(\d+)", winner.group(1)).group(1)) > 1, out  # the winner splits sequences


@pytest.fixture(scope="module")
def mixtral() -> ModelSpec:
    """Mixtral-8x7B's shapes read from Hugging Face's module on the meta device."""
    from examples.rehearse.mixtral import MixtralLM

    return spec_from_module(build_on_meta(MixtralLM), seq_len=4096)


def test_a_moe_model_counts_the_experts_a_token_is_routed_to(mixtral):
    """FLOPs per token: attention and the 2 routed experts of 8, not all 8; under expert parallelism the experts run
    whole on every tensor-parallel rank (the tensor plan leaves them out), so a tp rank does more of them."""
    one_expert = mixtral.expert_params / 8
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.fused_experts, mixtral.gated_mlp) == (8, 2, True, True)
    assert mixtral.expert_ffn == 14336
    assert mixtral.matmul_params_per_layer == mixtral.attention_params_per_layer + 2 * one_expert
    assert mixtral.routed_flops_per_token() == 2 * 2 * one_expert
    cluster = preset("h100-sxm", gpus=64, hbm_gbps=1e12)  # memory traffic out of the way: compute is FLOPs
    training, eff = Training(global_batch=64), Efficiency()
    base = dict(tp=2, dp=32, zero_stage=1, microbatching=Microbatching(count=2))
    times = {ep: step_time(mixtral, cluster, training, Layout.of(ep=ep, **base), eff)["compute"] for ep in (1, 8)}
    tokens, peak = 4096, cluster.peak_tflops * 1e12 * eff.gemm
    # 2 microbatches x 32 layers x 3 passes, the experts' share tp 2 no longer splits
    extra = 2 * 32 * 3 * mixtral.routed_flops_per_token() * tokens * (1 - 1 / 2) / peak
    assert times[8] - times[1] == pytest.approx(extra, rel=1e-6)


def test_expert_parallel_memory_and_what_the_planner_refuses_beside_it(mixtral):
    """Under ep a ZeRO-3 block gathers 1/ep of the experts instead of 1/tp of them; ZeRO 0-2 keep the gathered
    experts from forward to backward. ep is checked by the library's own checks, refused in its words: a divisor of
    dp and of the experts, without cp, sequence parallelism or HSDP, and positive."""
    cluster, training = preset("h100-sxm", gpus=64), Training(global_batch=64)
    zero3 = {ep: memory(mixtral, cluster, training, Layout.of(dp=64, zero_stage=3, ep=ep)) for ep in (1, 8)}
    assert zero3[8]["temporary"] < zero3[1]["temporary"] / 4
    # ZeRO 0-2: each replica holds 1/replicas of its experts (split within them), gathers the rest until backward.
    for ep in (2, 8):
        zero1 = memory(mixtral, cluster, training, Layout.of(dp=64, zero_stage=1, ep=ep))
        replicas = 64 // ep
        gathered = 32 * mixtral.expert_params / ep * 4 * (1 - 1 / replicas)  # layers x experts per rank x fp32
        dense = (mixtral.total_params - 32 * mixtral.expert_params) * 4  # whole at tp 1, ZeRO-1
        assert zero1["params"] == pytest.approx(32 * mixtral.expert_params / ep * 4 / replicas + dense)
        assert zero1["temporary"] >= gathered
    fixed = lambda text: " ".join(
        c for c in candidates(mixtral, cluster, training, parse_fix(text)) if isinstance(c, str)
    )
    assert "expert_parallel_size=3 must divide data_parallel_size=64" in fixed("tp=1,pp=1,ep=3")
    assert "context_parallel_size=2 does not compose with expert_parallel_size=8" in fixed("tp=1,pp=1,cp=2,ep=8")
    assert "expert_parallel_size=8 does not compose with sequence_parallel" in fixed("tp=2,pp=1,ep=8,sp=1")
    hsdp = fixed("tp=1,pp=1,ep=8,hsdp=8,zero=3")
    assert "data_parallel_shard_size=8 does not compose with expert_parallel_size=8" in hsdp
    with pytest.raises(ValueError, match=r"--fix ep=0: the expert-parallel size must be a positive integer"):
        parse_fix("ep=0")
    best = search(mixtral, cluster, training, fixed=parse_fix("tp=2,pp=1,ep=8")).best
    assert best is not None and best.layout.ep == 8 and not best.layout.options.sequence_parallel
    assert best.time["expert_parallel"] > 0
