"""The docs' figures, drawn from the code's own data: ``python docs/figures.py`` writes them to ``docs/figures/``.

- ``mesh.svg``: the ranks of a ``ParallelLayout`` (``coordinates``, ``describe``) and the groups they form;
- ``schedule-<name>.svg``: each pipeline schedule's timeline, played from torch's own orders
  (``parallel.pipeline.timeline``), beside the planner's bubble model;
- ``zero-memory.svg``: memory per rank at each ZeRO stage, from the planner's formulas (``planner.cost.memory``);
- ``tp-split.svg``: the column/row split of an MLP as ``tp_plan="auto"`` plans it for the demo GPT, its shapes
  read from the module;
- ``scaling_report.png`` and ``bench.png``: ``ScalingMonitor``'s and ``lightning-mgpu bench``'s own plots of a real
  CPU run, written by ``python docs/figures.py --runs`` (minutes; timings differ run to run, so they are not
  redrawn by the check, which verifies that they and the JSON they were drawn from are there).

The SVGs are plain text written here (no plotting library: the same bytes on every machine), so the docs build
(``docs/hooks.py``) and the tests compare them with what the code gives now: a figure cannot drift.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from xml.sax.saxutils import escape

OUT = Path(__file__).resolve().parent / "figures"
REPO = OUT.parent.parent
RUN_FIGURES = ("scaling_report.png", "scaling_report.json", "bench.png", "bench.json")
FONT = "font-family='Helvetica, Arial, sans-serif'"
RANK_COLORS = ("#5b8def", "#f29e4c", "#59b36b", "#c86bd6", "#e05d5d", "#4cb8b8", "#b5a33a", "#8a8a8a")
KIND_COLORS = {"F": "#5b8def", "B": "#f29e4c", "I": "#4cb8b8", "W": "#59b36b", "F+B": "#c86bd6"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradients", "W": "weight gradients", "F+B": "overlapped F+B"}


# ------------------------------------------------------------------------------------------------------- drawing
def _svg(width: float, height: float, title: str, body: list[str]) -> str:
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {width:.0f} {height:.0f}' width='{width:.0f}'"
        f" height='{height:.0f}' {FONT} font-size='12'>"
    )
    return "\n".join([head, f"<title>{escape(title)}</title>", *body, "</svg>"]) + "\n"


def _rect(x: float, y: float, w: float, h: float, fill: str, stroke: str = "#333", **extra: str) -> str:
    more = "".join(f" {k.replace('_', '-')}='{v}'" for k, v in extra.items())
    return f"<rect x='{x:.1f}' y='{y:.1f}' width='{w:.1f}' height='{h:.1f}' fill='{fill}' stroke='{stroke}'{more}/>"


def _text(x: float, y: float, text: str, size: int = 12, anchor: str = "start", **extra: str) -> str:
    more = "".join(f" {k.replace('_', '-')}='{v}'" for k, v in extra.items())
    return f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}'{more}>{escape(text)}</text>"


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str = "#333", **extra: str) -> str:
    more = "".join(f" {k.replace('_', '-')}='{v}'" for k, v in extra.items())
    return f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' stroke='{stroke}'{more}/>"


# ------------------------------------------------------------------------------------------------------- figures
def mesh() -> str:
    """pp=2 x dp=2 x tp=2: where each rank sits, and the groups each axis makes."""
    from lightning_mgpu import ParallelLayout

    layout = ParallelLayout(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1)
    cell_w, cell_h, gap, stage_gap = 118, 44, 10, 46
    stage_w = layout.tp * (cell_w + gap) + gap
    stage_h = layout.dp * (cell_h + 26) + 34
    body, left, top = [], 20, 58
    body.append(_text(20, 24, f"The mesh of {layout.describe()}: 8 ranks", 15, font_weight="bold"))
    body.append(
        _text(20, 44, "mesh axes (pp, dp, tp), tp innermost: consecutive ranks (one node's GPUs) share a layer")
    )
    for rank in range(layout.world_size):
        place = layout.coordinates(rank)
        sx = left + place["pp"] * (stage_w + stage_gap)
        if place["dp"] == 0 and place["tp"] == 0:
            body.append(_rect(sx, top, stage_w, stage_h, "#f6f6f6", "#999", rx="6"))
            body.append(_text(sx + 8, top + 18, f"pipeline stage {place['pp']}: blocks of stage {place['pp']}"))
        ry = top + 30 + place["dp"] * (cell_h + 26)
        if place["tp"] == 0:
            body.append(_rect(sx + gap / 2, ry - 4, stage_w - gap, cell_h + 8, "none", "#555", stroke_dasharray="4 3"))
            body.append(_text(sx + stage_w - 8, ry + cell_h + 18, f"dp replica {place['dp']}: a tp group", 10, "end"))
        x = sx + gap + place["tp"] * (cell_w + gap)
        body.append(_rect(x, ry, cell_w, cell_h, RANK_COLORS[place["tp"]], "#333", rx="4", fill_opacity="0.85"))
        body.append(_text(x + cell_w / 2, ry + 18, f"rank {rank}", 13, "middle", font_weight="bold"))
        body.append(
            _text(x + cell_w / 2, ry + 34, f"pp {place['pp']}  dp {place['dp']}  tp {place['tp']}", 11, "middle")
        )
    arrow_y = top + stage_h / 2
    x1 = left + stage_w
    body.append(_line(x1 + 4, arrow_y, x1 + stage_gap - 4, arrow_y, "#333", stroke_width="2", marker_end="url(#a)"))
    body.insert(
        0,
        "<defs><marker id='a' markerWidth='8' markerHeight='8' refX='7' refY='4' orient='auto'>"
        "<path d='M0,0 L8,4 L0,8 z' fill='#333'/></marker></defs>",
    )
    bottom = top + stage_h + 26
    notes = [
        "tp group (dashed): the ranks one layer's weights are split over (all-reduces every layer);",
        "dp group (same colour, same stage): the same weights, different samples (gradients averaged; ZeRO shards);",
        "pp group (same place in each stage): activations sent forward, gradients back (the arrow).",
    ]
    body += [_text(20, bottom + 16 * i, note, 11) for i, note in enumerate(notes)]
    return _svg(max(2 * stage_w + stage_gap + 40, 700), bottom + 16 * len(notes) + 6, "the mesh", body)


def schedule(name: str) -> str:
    """``name``'s timeline on 4 ranks, 8 microbatches: each rank's computations in torch's order."""
    from lightning_mgpu.parallel.pipeline import bubble_fraction, timeline

    played = timeline(name, 4, 8)
    unit, row, left, top = 22.0, 30.0, 64.0, 52.0
    width = left + played.makespan * unit + 20
    planned = bubble_fraction(played.pp_size, played.microbatches, played.stages_per_rank)
    stages = f"{played.stages_per_rank} stages per rank" if played.stages_per_rank > 1 else "one stage per rank"
    body = [
        _text(10, 20, f"{name}: pp=4, 8 microbatches, {stages}", 15, font_weight="bold"),
        _text(
            10,
            38,
            f"idle {played.idle_fraction:.1%} of the step (grey); the planner assumes (p-1)/(v·m+p-1) ="
            f" {planned:.1%}; peak activations on rank 0: {played.peak_in_flight(0):g} microbatches' worth",
            11,
        ),
    ]
    for rank in range(played.pp_size):
        y = top + rank * row
        body.append(_text(left - 8, y + 18, f"rank {rank}", 12, "end"))
        body.append(_rect(left, y, played.makespan * unit, row - 6, "#e6e6e6", "none"))
    for slot in played.slots:
        x, y = left + slot.start * unit, top + slot.rank * row
        second = played.stages_per_rank > 1 and slot.stage >= played.pp_size  # the rank's later stage: lighter
        shade = {"fill_opacity": "0.55"} if second else {}
        body.append(
            _rect(x, y, slot.duration * unit, row - 6, KIND_COLORS[slot.kind], "#222", stroke_width="0.5", **shade)
        )
        label = str(slot.microbatch) if played.stages_per_rank == 1 else f"{slot.microbatch}"
        if slot.duration * unit >= 9:
            body.append(_text(x + slot.duration * unit / 2, y + 16, label, 10, "middle", fill="#fff"))
    legend_y = top + played.pp_size * row + 14
    kinds = sorted({slot.kind for slot in played.slots}, key=list(KIND_COLORS).index)
    for i, kind in enumerate(kinds):
        x = left + i * 150
        body += [
            _rect(x, legend_y, 14, 12, KIND_COLORS[kind], "#222"),
            _text(x + 20, legend_y + 11, KIND_NAMES[kind], 11),
        ]
    note = "numbers: the microbatch; time in units of one rank's forward of a microbatch (a backward takes two)"
    body.append(_text(left, legend_y + 32, note, 10))
    if played.stages_per_rank > 1:
        body.append(
            _text(left, legend_y + 46, "lighter: the rank's second stage (looped: stages r and r+4; V: r and 7-r)", 10)
        )
    return _svg(max(width, 760), legend_y + 56, f"{name} pipeline schedule", body)


def zero_memory() -> str:
    """Memory per GPU of Llama-2-7B's shapes on 8 GPUs at each ZeRO stage, by kind, from the planner's model."""
    from lightning_mgpu.options import ParallelOptions
    from lightning_mgpu.planner import ModelSpec, Training, preset
    from lightning_mgpu.planner.cluster import GB
    from lightning_mgpu.planner.cost import memory
    from lightning_mgpu.planner.job import Layout, Microbatching

    model = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq_len=4096, ffn_hidden=11008, gated_mlp=True)
    cluster, training = preset("h100-sxm", gpus=8), Training(global_batch=32, precision="bf16-mixed")
    kinds = {
        "params": "#5b8def",
        "grads": "#f29e4c",
        "optimizer": "#59b36b",
        "activations": "#c86bd6",
        "temporary": "#9a9a9a",  # gathered parameters, communication buffers
    }
    stages = {}
    full = ParallelOptions(activation_checkpointing="full")
    for zero in range(4):
        layout = Layout.of(dp=8, zero_stage=zero, options=full, microbatching=Microbatching(size=1, count=4))
        stages[zero] = memory(model, cluster, training, layout)
    tallest = max(sum(parts.get(kind, 0.0) for kind in kinds) for parts in stages.values()) / GB
    left, base, bar = 70.0, 330.0, 90.0
    scale = 250.0 / max(tallest, cluster.usable_bytes / GB)
    body = [
        _text(
            10,
            20,
            "Memory per GPU by ZeRO stage: Llama-2-7B's shapes on 8 x H100 (80 GB), dp=8",
            15,
            font_weight="bold",
        ),
        _text(
            10,
            38,
            "bf16-mixed, fp32 AdamW (16 bytes a parameter), microbatches of one 4096-token sequence, full"
            " activation checkpointing;",
            11,
        ),
        _text(10, 52, "the planner's formulas (planner/cost.py), as `lightning-mgpu plan` predicts", 11),
    ]
    usable = cluster.usable_bytes / GB
    body.append(
        _line(
            left - 6,
            base - usable * scale,
            left + 4 * (bar + 40),
            base - usable * scale,
            "#e05d5d",
            stroke_dasharray="5 4",
        )
    )
    body.append(
        _text(left + 4 * (bar + 40), base - usable * scale - 4, f"{usable:.1f} GB usable", 10, "end", fill="#e05d5d")
    )
    for zero, parts in stages.items():
        x, y = left + zero * (bar + 40), base
        for kind, color in kinds.items():
            height = parts.get(kind, 0.0) / GB * scale
            y -= height
            body.append(_rect(x, y, bar, height, color, "#222", stroke_width="0.5"))
            if height > 12:
                body.append(
                    _text(x + bar / 2, y + height / 2 + 4, f"{parts[kind] / GB:.1f}", 10, "middle", fill="#fff")
                )
        total = sum(parts.get(kind, 0.0) for kind in kinds) / GB
        body.append(_text(x + bar / 2, y - 6, f"{total:.1f} GB", 12, "middle", font_weight="bold"))
        body.append(_text(x + bar / 2, base + 18, f"zero_stage={zero}", 12, "middle"))
    body.append(_line(left - 6, base, left + 4 * (bar + 40), base))
    for i, (kind, color) in enumerate(kinds.items()):
        body += [
            _rect(left + i * 105, base + 34, 14, 12, color, "#222"),
            _text(left + i * 105 + 20, base + 45, kind, 11),
        ]
    notes = "0: replicated (DDP); 1: optimizer states sharded over the 8 ranks; 2: + gradients; 3: + parameters"
    body.append(_text(left, base + 70, notes, 11))
    return _svg(720, base + 84, "memory per GPU by ZeRO stage", body)


def tp_split() -> str:
    """The demo GPT's MLP at tp=2 as tp_plan="auto" plans it: c_fc by columns, c_proj by rows, one all-reduce."""
    import torch

    from lightning_mgpu.demo import GPTLightningModule
    from lightning_mgpu.parallel.tensor import auto_plan

    with torch.device("meta"):
        module = GPTLightningModule(vocab_size=65, block_size=32, n_layer=1, n_head=4, n_embd=64)
    plan = auto_plan(module)
    up_name, down_name = "model.transformer.h.*.mlp.c_fc", "model.transformer.h.*.mlp.c_proj"
    up = module.model.transformer.h[0].mlp.c_fc
    hidden, inner, tp = up.in_features, up.out_features, 2
    body = [
        _text(
            10, 20, "Tensor parallelism at tp=2: the demo GPT's MLP as tp_plan='auto' plans it", 15, font_weight="bold"
        ),
        _text(
            10,
            38,
            f"plan: c_fc {plan[up_name]!r}, c_proj {plan[down_name]!r} (derived from the block's names;"
            f" c_fc.weight [{inner}, {hidden}], c_proj.weight [{hidden}, {inner}])",
            11,
        ),
    ]
    top = 70
    for rank in range(tp):
        y = top + rank * 150
        color = RANK_COLORS[rank]
        body.append(_text(10, y + 40, f"rank {rank}", 13, font_weight="bold"))
        body += [_rect(70, y + 20, 90, 40, "#dddddd"), _text(115, y + 44, f"x [T, {hidden}]", 11, "middle")]
        body.append(_text(115, y + 76, "whole on both ranks", 10, "middle"))
        body += [_rect(200, y, 70, 80, "#f2f2f2", "#bbb"), _rect(200, y + rank * 40, 70, 40, color)]
        body.append(_text(235, y + 96, f"c_fc rows {rank * inner // tp}..{(rank + 1) * inner // tp - 1}", 10, "middle"))
        body.append(_text(235, y + 110, f"colwise: [{inner // tp}, {hidden}] here", 10, "middle"))
        body += [
            _rect(310, y + 20, 90, 40, color, fill_opacity="0.6"),
            _text(355, y + 44, f"h [T, {inner // tp}]", 11, "middle"),
        ]
        body.append(_text(355, y + 76, "GELU on its half", 10, "middle"))
        body += [_rect(440, y, 80, 80, "#f2f2f2", "#bbb"), _rect(440 + rank * 40, y, 40, 80, color)]
        body.append(
            _text(480, y + 96, f"c_proj columns {rank * inner // tp}..{(rank + 1) * inner // tp - 1}", 10, "middle")
        )
        body.append(_text(480, y + 110, f"rowwise: [{hidden}, {inner // tp}] here", 10, "middle"))
        body += [
            _rect(560, y + 20, 90, 40, color, fill_opacity="0.35"),
            _text(605, y + 44, f"partial [T, {hidden}]", 11, "middle"),
        ]
        for x1, x2 in ((160, 200), (270, 310), (400, 440), (520, 560)):
            body.append(_line(x1, y + 40, x2, y + 40, "#333", marker_end="url(#a)"))
        body.append(_line(650, y + 40, 690, top + 115, "#333", marker_end="url(#a)"))
    body.insert(
        0,
        "<defs><marker id='a' markerWidth='8' markerHeight='8' refX='7' refY='4' orient='auto'>"
        "<path d='M0,0 L8,4 L0,8 z' fill='#333'/></marker></defs>",
    )
    body += [_rect(695, top + 95, 110, 40, "#dddddd"), _text(750, top + 113, "all-reduce (sum)", 11, "middle")]
    body.append(_text(750, top + 128, f"y [T, {hidden}] on both", 10, "middle"))
    notes = [
        "colwise splits a weight's output features: each rank computes its half of h, with no communication;",
        "rowwise splits its input features: each rank's product is a partial sum of y, added up by one all-reduce.",
        "Attention splits the same way by heads (q/k/v colwise, the output projection rowwise).",
    ]
    body += [_text(10, top + 310 + 16 * i, note, 11) for i, note in enumerate(notes)]
    return _svg(820, top + 310 + 16 * len(notes), "tensor-parallel column and row split", body)


def figures() -> dict[str, Callable[[], str]]:
    """Every drawn figure, by file name."""
    from lightning_mgpu.parallel.pipeline import PIPELINE_SCHEDULES

    drawn: dict[str, Callable[[], str]] = {"mesh.svg": mesh, "zero-memory.svg": zero_memory, "tp-split.svg": tp_split}
    for name in PIPELINE_SCHEDULES:
        drawn[f"schedule-{name}.svg"] = lambda name=name: schedule(name)
    return drawn


def stale() -> list[str]:
    """The figures whose file differs from what the code draws now, or is missing (the runs' files included)."""
    found = [
        name for name, draw in figures().items() if not (OUT / name).is_file() or (OUT / name).read_text() != draw()
    ]
    return found + [name for name in RUN_FIGURES if not (OUT / name).is_file()]


# ------------------------------------------------------------------------------------------------ real CPU runs
def runs() -> None:
    """``ScalingMonitor``'s and ``lightning-mgpu bench``'s PNGs from real runs on this machine's CPU (2 processes)."""
    import shutil
    import tempfile

    from lightning_mgpu.cli import main

    gpt = ["--module", "lightning_mgpu.demo:GPTLightningModule", "--datamodule", "lightning_mgpu.demo:TextDataModule"]
    shapes = ["--init-args", '{"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}']
    with tempfile.TemporaryDirectory() as work:
        bench = ["bench", *gpt, *shapes, "--datamodule-args", '{"block_size": 32}', "--devices", "2", "--steps", "6"]
        if main([*bench, "--warmup-steps", "2", "--batch-size", "4", "--out", work]) != 0:
            raise SystemExit("the bench run failed")
        for name in ("bench.png", "bench.json"):
            shutil.copy(Path(work, name), OUT / name)
        report = Path(work, "dp1_tp1_pp2")  # the sweep's pipeline run: compute, communication and bubble
        for name in ("scaling_report.png", "scaling_report.json"):
            shutil.copy(report / name, OUT / name)
    summary = json.loads((OUT / "bench.json").read_text())
    summary["args"] = {k: v for k, v in summary["args"].items() if k not in ("out", "run")}  # no temporary paths
    (OUT / "bench.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which figures are stale (exit 1 if any)")
    parser.add_argument("--runs", action="store_true", help="also redo the real CPU runs' PNGs (minutes)")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        print("\n".join(found) or "every figure is up to date")
        return 1 if found else 0
    OUT.mkdir(exist_ok=True)
    for name, draw in figures().items():
        (OUT / name).write_text(draw())
    if args.runs:
        runs()
    print(f"wrote {len(figures())} figures to {OUT}" + (" and the runs' PNGs" if args.runs else ""))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
