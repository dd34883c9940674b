"""The conformance suites' case lists: Lightning's Trainer features (``tests/test_lightning_features.py``) and
Lightning's own examples (``tests/test_lightning_examples.py``) under every layout, each against Lightning's own
``DDPStrategy`` on the same number of processes, and the docs page made from the lists.

A cell is one subject (a feature, an example) under one layout, with what it must do: train *equal* to DDP
(losses, logged metrics and predictions within 1e-5 relative, weights 1e-4), be *refused* before the first step
with a message the test matches, or be refused *by Lightning itself*, as under DDP. A cell another line of work
owns and that does not hold yet is *known*, with its reason: its test asserts the failure it has, so it is noticed
when it starts to pass. The page (``docs/guides/lightning-features.md``) is printed by ``render_page()``;
``python -m tests.helpers.conformance > docs/guides/lightning-features.md`` regenerates it, and a test checks that
the page equals what it prints, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from tests.helpers.tiers import case

LOSS_RTOL = 1e-5  # losses, logged metrics, predictions, learning rates: relative
WEIGHT_RTOL = 1e-4
WEIGHT_ATOL = 1e-5
PREDICTION_ATOL = 1e-6  # beside 1e-5 relative: outputs near zero differ by the float32 rounding of their neighbours

Expect = Literal["equal", "refused", "lightning", "known", "differs"]


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    kwargs: dict[str, Any]
    dp: int  # data-parallel ranks: each holds GLOBAL_BATCH // dp samples per step


LAYOUTS: dict[str, Layout] = {
    "dp2 ZeRO-0": Layout(2, {}, 2),
    "dp2 ZeRO-1": Layout(2, {"zero_stage": 1}, 2),
    "dp2 ZeRO-2": Layout(2, {"zero_stage": 2}, 2),
    "dp2 ZeRO-3": Layout(2, {"zero_stage": 3}, 2),
    "tp2": Layout(2, {"tensor_parallel_size": 2}, 1),
    "pp2": Layout(2, {"pipeline_parallel_size": 2}, 1),
    "dp2 x tp2": Layout(4, {"data_parallel_size": 2, "tensor_parallel_size": 2}, 2),
    "pp2 x dp2": Layout(4, {"pipeline_parallel_size": 2, "data_parallel_size": 2}, 2),
}
DDP = "DDP"  # the reference: Lightning's DDPStrategy on `world` processes, GLOBAL_BATCH // world samples per rank


@dataclasses.dataclass(frozen=True)
class Cell:
    subject: str
    layout: str
    expect: Expect = "equal"
    why: str = ""  # for refused/known cells: the reason, shown on the page
    match: str = ""  # refused/known: a regex the failure's message must match
    slow: bool = True


@dataclasses.dataclass(frozen=True)
class Subject:
    key: str
    title: str  # as the page shows it (Markdown)
    run: str  # the run (of the suite's own table) that exercises it
    cells: Callable[[str], tuple[Expect, str, str]] = lambda layout: ("equal", "", "")


def params(table: list[Cell]) -> list[Any]:
    """The cells as pytest parameters, ``subject-layout`` ids, the slow ones in the slow tier."""
    return [case(c, id=f"{c.subject}-{c.layout.replace(' ', '')}", slow=c.slow) for c in table]


def cells(subjects: Sequence[Subject], quick: set[tuple[str, str]]) -> list[Cell]:
    """Every subject under every layout; ``quick`` names the (subject, layout) cells of the quick tier."""
    out = []
    for subject in subjects:
        for layout in LAYOUTS:
            expect, why, match = subject.cells(layout)
            assert expect not in ("refused", "lightning", "known") or match, (subject.key, layout)  # what to match
            out.append(Cell(subject.key, layout, expect, why, match, slow=(subject.key, layout) not in quick))
    return out


# ------------------------------------------------------------------------------------------------------ features
_AVERAGING_PIPELINED = (
    "the callback pairs a whole copy of the module, made before the strategy parallelizes it, with the module's"
    " parameters by position: under pipeline parallelism each rank holds its stages only, which that copy cannot be"
    " paired with; it trains under data parallelism (ZeRO 0-3) and tensor parallelism, where the copy is laid out"
    " as the parallelized module"
)
_SWA_SHARDED = (
    "`StochasticWeightAveraging` pairs a whole copy of the module, made before the strategy parallelizes it, with"
    " the module's parameters by position and saves that copy in the callback's own state, which one rank writes:"
    " under ZeRO-2/3 and tensor parallelism the parameters are shards, under pipeline parallelism each rank holds"
    " its stages only (Lightning refuses FSDP and DeepSpeed alike); it trains at ZeRO-0/1 with data parallelism"
    " alone, and `EMAWeightAveraging`/`WeightAveraging` train under every layout but pipelining"
)


def _stochastic_averaging(layout: str) -> tuple[Expect, str, str]:
    if layout in ("dp2 ZeRO-0", "dp2 ZeRO-1"):
        return "equal", "", ""
    return "refused", _SWA_SHARDED, "keeps a whole copy of the module"


def _averaging(layout: str) -> tuple[Expect, str, str]:
    if "pp2" in layout:
        return "refused", _AVERAGING_PIPELINED, "keeps a whole copy of the module"
    return "equal", "", ""


_LR_FIND_RANK_ZERO = (
    "the tuner records rank 0's own loss of each step (unreduced; under DDP the other ranks receive rank 0's"
    " curve): DDP's rank 0 holds 1/world of each global batch, here rank 0 holds 1/dp, so its curve and"
    " suggestion differ by construction; with as many data-parallel ranks as DDP's they are equal"
)


def _rank_zero_curve(layout: str) -> tuple[Expect, str, str]:
    if LAYOUTS[layout].dp == LAYOUTS[layout].world:
        return "equal", "", ""
    return "differs", _LR_FIND_RANK_ZERO, ""


def _lightning_refuses(why: str, match: str) -> Callable[[str], tuple[Expect, str, str]]:
    return lambda layout: ("lightning", why, match)


FEATURES: list[Subject] = [
    Subject(
        "evaluate",
        "`trainer.validate` / `test` / `predict` (predictions returned on every rank), `torch.inference_mode`"
        " (the Trainer's default) with DTensor parameters",
        "evaluate",
    ),
    Subject("log", "`self.log(sync_dist=True)` with `on_step` and `on_epoch`", "evaluate"),
    Subject("all_gather", "`self.all_gather`", "evaluate"),
    Subject("best", '`ModelCheckpoint(monitor=..., save_top_k=2)`, then `trainer.test(ckpt_path="best")`', "evaluate"),
    Subject(
        "load_from_checkpoint",
        "`trainer.save_checkpoint(path)`, then `MyModule.load_from_checkpoint(path)` (default format)",
        "evaluate",
    ),
    Subject("lr_monitor", "`LearningRateMonitor`", "evaluate"),
    Subject("plateau", "`ReduceLROnPlateau` with `monitor`", "schedules"),
    Subject("early_stopping", "`EarlyStopping`", "schedules"),
    Subject("clip_norm", "`gradient_clip_val` (norm)", "schedules"),
    Subject("accumulation_scheduler", "`GradientAccumulationScheduler`", "schedules"),
    Subject("clip_value", '`gradient_clip_val` with `gradient_clip_algorithm="value"`', "clip_value"),
    Subject("accumulate", "`accumulate_grad_batches`", "clip_value"),
    Subject("swa", "`StochasticWeightAveraging`", "swa", _stochastic_averaging),
    Subject(
        "ema",
        "`EMAWeightAveraging` (Lightning's `WeightAveraging`), its checkpoints loaded and resumed",
        "ema",
        _averaging,
    ),
    Subject("lr_find", "Tuner `lr_find`", "lr_find", _rank_zero_curve),
    Subject(
        "scale_batch_size",
        "Tuner `scale_batch_size`",
        "scale_batch_size",
        _lightning_refuses(
            "Lightning's tuner refuses every distributed strategy, DDP included",
            "Tuning the batch size is currently not supported with distributed strategies",
        ),
    ),
    Subject(
        "several_optimizers",
        "several optimizers with automatic optimization",
        "several_optimizers",
        _lightning_refuses(
            "Lightning 2 trains several optimizers only under manual optimization, under any strategy",
            "Training with multiple optimizers is only supported with manual optimization",
        ),
    ),
]
_QUICK_FEATURES = {
    (subject, layout)
    for layout in ("dp2 ZeRO-3", "tp2", "pp2")
    for subject in ("evaluate", "log", "all_gather", "best", "load_from_checkpoint", "lr_monitor")
} | {
    ("plateau", "dp2 ZeRO-3"),
    ("early_stopping", "dp2 ZeRO-3"),
    ("clip_norm", "dp2 ZeRO-3"),
    ("accumulation_scheduler", "dp2 ZeRO-3"),
    ("clip_value", "tp2"),
    ("accumulate", "tp2"),
    ("ema", "dp2 ZeRO-0"),
    ("ema", "dp2 ZeRO-3"),
    ("ema", "tp2"),
    ("swa", "pp2"),
    ("lr_find", "dp2 ZeRO-1"),
    ("scale_batch_size", "dp2 ZeRO-0"),
    ("several_optimizers", "tp2"),
}
FEATURE_CELLS = cells(FEATURES, _QUICK_FEATURES)


# ------------------------------------------------------------------------------------------------------ examples
_TP_NO_BLOCKS = (
    '`tp_plan="auto"` finds no repeated blocks of Linear layers to split: the message lists the Linear layers and'
    " asks for an explicit `tp_plan` dict",
    r"tp_plan='auto' found neither a Hugging Face tensor-parallel plan nor a list of repeated blocks to shard",
)
_PP_NO_LAYERS = (
    "no `ModuleList`/`Sequential` of layers to cut into stages; the message asks for `pipeline_split`",
    r"pipeline_parallel_size > 1 needs the model's layers in a ModuleList/Sequential",
)
_PP_MANUAL = (
    "the pipeline schedule runs each microbatch's backward itself, so it needs automatic optimization",
    r"runs forward and backward inside the pipeline schedule .* so it needs automatic optimization",
)
_DQN_PP = (
    "a module holding a copy of its network beside it: each stage would hold only its part of the network and all"
    " of the target, so `target_net.load_state_dict(net.state_dict())` cannot work; refused at setup, naming both"
    " and the layouts that train it (tensor and data parallelism)",
    r"also holds 'target_net', a copy of it",
)
_DROPOUT = (
    "the demo builds its `nn.Transformer` with dropout 0.2: DDP draws each rank's masks for its own samples, tensor"
    " and pipeline parallelism draw them for the whole batch (tp peers alike), so no run matches DDP's masks; the"
    " losses differ from the first step, by construction (measured: 4e-4 to 3e-3). With dropout 0 the same module"
    " trains like one process under tp 2 and pp 2 (tests/parallel/tensor/test_derive_from_call.py,"
    " tests/parallel/pipeline/test_torch_transformer.py)",
    "",
)
_UNFROZEN_DDP = (
    "Lightning's `DDPStrategy` builds its reducer over the parameters that need a gradient when it wraps the"
    " module, so the backbone `MilestonesFinetuning` unfreezes later is stepped on each rank's own gradient, never"
    " averaged (the ranks' weights drift apart); ours rebuilds the reducer when the trainable set changes and"
    " averages them, as one process on the global batch does (measured 1.3e-5 relative from DDP at the milestone;"
    " tests/test_finetuning.py compares unfreezing with one process)",
    "",
)
_BATCHNORM_PP = (
    "BatchNorm normalizes over what one forward holds: under pipeline parallelism a microbatch of consecutive"
    " samples, where each DDP rank holds every other sample; no DDP run on the same processes computes these"
    " statistics, so the losses differ from the first step, by construction (measured)",
    "",
)


def _expected(
    tp: tuple[str, str] | None = _TP_NO_BLOCKS,
    pp: tuple[str, str] | None = _PP_NO_LAYERS,
    known: dict[str, tuple[str, str]] | None = None,
    refused: dict[str, tuple[str, str]] | None = None,
    tp_known: bool = False,
    tp_differs: bool = False,
    pp_known: bool = False,
    pp_differs: bool = False,
    differs: tuple[str, str] | None = None,
) -> Callable[[str], tuple[Expect, str, str]]:
    """An example's cells: equal under data parallelism (but the ``known`` and ``refused`` layouts), tensor- and
    pipeline-parallel layouts refused (``tp``/``pp`` a reason and the message, ``None``: equal) or known;
    ``differs``: data parallelism differs from DDP's, by construction, for that reason."""

    def cell(layout: str) -> tuple[Expect, str, str]:
        if known and layout in known:
            return ("known", *known[layout])
        if refused and layout in refused:
            return ("refused", *refused[layout])
        if "tp2" in layout:
            reason, kind = tp, "known" if tp_known else "differs" if tp_differs else "refused"
        elif "pp2" in layout:
            reason, kind = pp, "known" if pp_known else "differs" if pp_differs else "refused"
        elif differs is not None:
            reason, kind = differs, "differs"
        else:
            reason, kind = None, "equal"
        return ("equal", "", "") if reason is None else (kind, *reason)

    return cell


EXAMPLES: list[Subject] = [
    Subject("boring", "`BoringModel` (demos), its own data", "boring", _expected()),
    Subject("demo", "`DemoModel` (demos) with `BoringDataModule`", "demo", _expected()),
    Subject("manual_boring", "`ManualOptimBoringModel` (demos)", "manual_boring", _expected(pp=_PP_MANUAL)),
    Subject(
        "transformer",
        "`LightningTransformer` (demos, torch's `nn.Transformer`), WikiText-2-shaped tokens",
        "transformer",
        _expected(tp=_DROPOUT, pp=_DROPOUT, tp_differs=True, pp_differs=True),
    ),
    Subject(
        "autoencoder",
        "basics: `LitAutoEncoder`, then `test`/`predict` from the best checkpoint",
        "autoencoder",
        _expected(pp=None),
    ),
    Subject(
        "classifier",
        "basics: `LitClassifier` (backbone), then `test`/`predict` from the best checkpoint",
        "classifier",
        _expected(),
    ),
    Subject("gan", "domain templates: GAN (manual optimization, two optimizers)", "gan", _expected(pp=_PP_MANUAL)),
    Subject("dqn", "domain templates: DQN (a target network, CartPole)", "dqn", _expected(pp=_DQN_PP)),
    Subject(
        "ppo",
        "domain templates: PPO (manual optimization, rollouts of the policy in the data loader)",
        "ppo",
        _expected(pp=_PP_MANUAL),
    ),
    Subject(
        "finetuning",
        "domain templates: fine-tuning with `MilestonesFinetuning` (freezing, BatchNorm, param groups added)",
        "finetuning",
        _expected(
            pp=_BATCHNORM_PP,
            pp_differs=True,
            differs=_UNFROZEN_DDP,
        ),
    ),
]
_QUICK_EXAMPLES = {
    ("boring", "dp2 ZeRO-3"),
    ("demo", "tp2"),
    ("manual_boring", "pp2"),
    ("transformer", "dp2 ZeRO-3"),
    ("autoencoder", "pp2"),
    ("classifier", "dp2 ZeRO-2"),
    ("gan", "dp2 ZeRO-1"),
    ("dqn", "dp2 ZeRO-3"),
    ("ppo", "dp2 ZeRO-2"),
    ("finetuning", "dp2 ZeRO-0"),
}
EXAMPLE_CELLS = cells(EXAMPLES, _QUICK_EXAMPLES)


# ----------------------------------------------------------------------------------------------------- compare
def worst_relative(got: Any, expected: Any) -> float:
    """The largest relative difference between two nested structures of numbers and tensors (0 if identical)."""
    pairs = list(_leaves(got, expected, ""))
    worst = 0.0
    for where, a, b in pairs:
        a_t = torch.as_tensor(a, dtype=torch.float64)
        b_t = torch.as_tensor(b, dtype=torch.float64)
        if a_t.shape != b_t.shape:
            raise AssertionError(f"{where}: shape {tuple(a_t.shape)} != {tuple(b_t.shape)}")
        scale = b_t.abs().clamp_min(1e-12)
        diff = ((a_t - b_t).abs() / scale).max().item() if a_t.numel() else 0.0
        worst = max(worst, diff if not math.isnan(diff) else math.inf)
    return worst


def worst_absolute(got: Any, expected: Any) -> float:
    """The largest absolute difference between two nested structures of numbers and tensors."""
    worst = 0.0
    for _, a, b in _leaves(got, expected, ""):
        diff = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs()
        worst = max(worst, diff.max().item() if diff.numel() else 0.0)
    return worst


def assert_close_tree(got: Any, expected: Any, rtol: float = LOSS_RTOL, atol: float = 0.0, what: str = "") -> None:
    """Every number of ``got`` equal to ``expected``'s within ``rtol`` (and ``atol``); the structures equal."""
    for where, a, b in _leaves(got, expected, what):
        torch.testing.assert_close(
            torch.as_tensor(a, dtype=torch.float64),
            torch.as_tensor(b, dtype=torch.float64),
            rtol=rtol,
            atol=atol,
            msg=lambda m, where=where: f"{where}: {m}",
        )


def _leaves(got: Any, expected: Any, where: str) -> Any:
    if isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (
            f"{where}: keys differ: missing {sorted(set(expected) - set(got or {}))},"
            f" unexpected {sorted(set(got or {}) - set(expected))}"
        )
        for key in expected:
            yield from _leaves(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), (
            f"{where}: {len(got) if isinstance(got, (list, tuple)) else got!r} items, expected {len(expected)}"
        )
        for i, (a, b) in enumerate(zip(got, expected)):
            yield from _leaves(a, b, f"{where}[{i}]")
    elif isinstance(expected, (str, bool, type(None))):
        assert got == expected, f"{where}: {got!r} != {expected!r}"
    else:
        yield where, got, expected


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = WEIGHT_ATOL):
    assert_close_tree(got, expected, rtol=WEIGHT_RTOL, atol=atol, what="weights")


# -------------------------------------------------------------------------------------------------------- page
_MARK = {
    "equal": "= DDP",
    "refused": "refused",
    "lightning": "Lightning refuses",
    "known": "known",
    "differs": "differs",
}


def _table(subjects: list[Subject], table_cells: list[Cell]) -> list[str]:
    by_key = {(c.subject, c.layout): c for c in table_cells}
    notes: dict[str, int] = {}
    lines = ["| | " + " | ".join(LAYOUTS) + " |", "|---|" + "---|" * len(LAYOUTS)]
    for subject in subjects:
        row = []
        for layout in LAYOUTS:
            cell = by_key[subject.key, layout]
            mark = _MARK[cell.expect]
            if cell.why:
                number = notes.setdefault(cell.why, len(notes) + 1)
                mark += f" ({number})"
            row.append(mark)
        lines.append(f"| {subject.title} | " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"- ({n}) {why}." for why, n in notes.items()]
    return lines


def render_page() -> str:
    """The docs page ``docs/guides/lightning-features.md``, from the case lists (examples registered first)."""
    layouts = ", ".join(
        f"`{name}`: `HybridStrategy({', '.join(f'{k}={v}' for k, v in layout.kwargs.items())})` on"
        f" {layout.world} processes"
        for name, layout in LAYOUTS.items()
    )
    lines = [
        "# Lightning features and examples",
        "",
        "<!-- Generated by `python -m tests.helpers.conformance` from the suites' case lists"
        " (tests/test_lightning_features.py, tests/test_lightning_examples.py); tests/test_docs.py checks it. -->",
        "",
        "```py",
        "trainer = L.Trainer(devices=2, strategy=HybridStrategy(zero_stage=3), callbacks=[EarlyStopping('val_loss')])",
        "trainer.fit(model, datamodule)  # the LightningModule and callbacks as they are under DDPStrategy",
        "```",
        "",
        "What of Lightning's own Trainer features and published examples trains under each layout, against"
        " Lightning's own `DDPStrategy` on the same number of processes and the same global batches: **= DDP** is"
        " equal within the suite's tolerances (fp32: losses, logged metrics, learning rates and predictions 1e-5"
        " relative, predictions also 1e-6 absolute; weights 1e-4 relative and 1e-5 absolute), **refused** stops"
        " with a message naming the reason and what trains it, before the first step (or, where its note says so,"
        " at the first forward, before any update), **Lightning refuses** is Lightning's own refusal, under DDP"
        " too, **differs** trains but differs from DDP by construction, as its note says (no DDP run on the same"
        " processes computes the same thing), and **known** does not hold yet, for the reason its note gives"
        " (another line of work owns each: the cell's test asserts the failure it has, so that it is noticed when"
        " it is fixed).",
        "",
        f"Layouts: {layouts}.",
        "",
        "## Trainer features",
        "",
        "One small module (an input layer, four residual MLP blocks that tensor parallelism splits column- then"
        " row-wise and pipeline parallelism cuts into stages, a head) with validation, test and predict steps,"
        " trained a few epochs with each feature.",
        "",
        *_table(FEATURES, FEATURE_CELLS),
        "",
        "## Lightning's examples",
        "",
        "The LightningModules of `lightning.pytorch.demos` as they ship, and those of the Lightning repository's"
        " `examples/pytorch` written out as published (their layers and step logic), each with synthetic data of"
        " its dataset's shapes; torchvision is not a dependency, so the fine-tuning example's ResNet-50 is a small"
        " CNN with ResNet's children (convolution, norm, ReLU, pooling, four stages, average pooling, the"
        " classifier dropped) and 2048 output features, and Gym's CartPole is a seeded synthetic environment with"
        " its observation and action spaces.",
        "",
        *_table(EXAMPLES, EXAMPLE_CELLS),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_page(), end="")
