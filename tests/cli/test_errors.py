"""The command line ends every user error in one line naming the value and the fix, with a non-zero exit (2 for a
usage error), never a traceback; ``--help``, ``--version`` and a mistyped command import neither torch nor
Lightning; every option has help text and shows its default once."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from lightning_mgpu.cli import build_parser, main
from lightning_mgpu.cli.errors import HelpFormatter
from lightning_mgpu.extras import EXTRAS
from tests.helpers.tiers import case

REPO = Path(__file__).resolve().parents[2]
GPT = "lightning_mgpu.demo:GPTLightningModule"
SHAPES = ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "99", "--seq-len", "32"]


def _files(tmp_path: Path) -> dict[str, str]:
    """A text file that is not a checkpoint, a directory, and a full checkpoint file."""
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    (tmp_path / "ckpt").mkdir()
    torch.save({"state_dict": {"w": torch.ones(2, 3)}, "epoch": 0, "global_step": 1}, tmp_path / "full.ckpt")
    return {name: str(tmp_path / name) for name in ("notes.txt", "ckpt", "full.ckpt")}


# (argv with {file} placeholders, exit status, what the message must contain: the value and the fix)
BAD_INPUTS = [
    (["plan", "--module", GPT, "--init-args", '{"n_layr": 2}'], 2, "unexpected keyword argument 'n_layr'"),
    (["plan", "--module", GPT, "--init-args", '{"n_layer": "two"}'], 2, '"two"'),
    (["plan", "--module", GPT, "--init-args", "{bad"], 2, "--init-args is not valid JSON"),
    (["plan", "--module", "torch.nn:Linear"], 2, "missing a required argument: 'in_features'"),
    (["plan", "--module", "lightning_mgpu.demo"], 2, "'lightning_mgpu.demo' names a module: add the class"),
    (["plan", "--module", "lightning_mgpu.demo.module"], 2, "names a module: add the class"),
    (["plan", "--module", "no_such_package.mod:Model"], 2, "cannot import 'no_such_package.mod'"),
    (["plan", "--module", "lightning_mgpu:__version__"], 2, "is a str, not a class"),
    (["plan", *SHAPES, "--gpus", "0"], 2, "argument --gpus: must be a positive integer, got '0'"),
    (["plan", *SHAPES, "--hidden", "-64"], 2, "argument --hidden: must be a positive integer, got '-64'"),
    (["plan", *SHAPES, "--global-batch", "0"], 2, "got '0'"),
    (["plan", *SHAPES, "--gpu-memory-gb", "-1"], 2, "argument --gpu-memory-gb: must be a positive number"),
    (["plan", *SHAPES, "--top", "0"], 2, "argument --top"),
    (["plan", *SHAPES, "--gpu", "tpu"], 2, "Unknown --gpu 'tpu'"),
    (["plan", *SHAPES, "--fix", "tp=abc"], 2, "'abc' is not a valid int"),
    (["plan", *SHAPES, "--fix", "schedule=Nope"], 2, "--fix schedule=Nope: choose one of GPipe"),
    (["plan", *SHAPES, "--precision", "fp9"], 2, "invalid choice: 'fp9'"),
    (["plan", *SHAPES, "--precision", "fp8-mixed", "--gpu", "a100-80gb"], 2, "which a100-80gb lacks"),
    (["plan", *SHAPES, "--kv-heads", "3"], 2, "kv_heads=3: fix --kv-heads"),
    (["plan", *SHAPES, "--experts-per-token", "2"], 2, "--experts-per-token 2 needs --experts"),
    (["plan", *SHAPES, "--rehearse"], 2, "--rehearse plays the real module: give --module"),
    (["demo", "--zero-stage", "5"], 2, "`zero_stage` must be one of (0, 1, 2, 3)"),
    (["demo", "--tensor-parallel-size", "3"], 2, "tensor_parallel_size=3 x pipeline_parallel_size=2"),
    (["demo", "--devices", "0"], 2, "argument --devices: must be a positive integer, got '0'"),
    (["demo", "--data-parallel-size", "x"], 2, "got 'x'"),
    (["demo", "--pipeline-schedule", "Nope"], 2, "got 'Nope'"),
    (["demo", "--precision", "64-bad"], 2, "64-bad"),
    (["demo", "--n-embd", "30"], 2, "--n-embd 30 must be a multiple of --n-head 4"),
    (["demo", "--batch-size", "15"], 2, "--batch-size 15 must be divisible by the data-parallel size 2"),
    (["inspect", "{notes.txt}"], 1, "notes.txt is not a checkpoint"),
    (["inspect", "{ckpt}/missing"], 1, "does not exist"),
    (["consolidate", "{full.ckpt}", "{full.ckpt}"], 2, "is the checkpoint being read"),
    (["consolidate", "{ckpt}", "{ckpt}/model.ckpt"], 2, "lies inside the checkpoint directory"),
    (["consolidate", "{full.ckpt}", "{ckpt}"], 2, "is a directory: give the file to write"),
    (["consolidate", "{ckpt}/missing", "{ckpt}.ckpt"], 1, "does not exist"),
    (["consolidate", "{full.ckpt}", "out.st", "--format", "npz"], 2, "invalid choice: 'npz'"),
    (["bench", "--module", GPT, "--devices", "2", "--init-args", '{"n_layr": 2}'], 2, "'n_layr'"),
    (["bench", "--module", GPT, "--devices", "2", "--device-counts", "1,5"], 2, "must lie in 1..2"),
    (["bench", "--module", GPT, "--devices", "2", "--pipeline-schedule", "Nope"], 2, "got 'Nope'"),
    (["pln"], 2, "unknown command 'pln': did you mean 'plan'?"),
]


@pytest.mark.parametrize(("argv", "status", "message"), BAD_INPUTS, ids=[" ".join(a[:3]) for a, _, _ in BAD_INPUTS])
def test_a_bad_input_ends_in_one_line_naming_the_value(argv, status, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("lightning.pytorch", "lightning.fabric"):  # their info lines (the Trainer's devices), not ours
        monkeypatch.setattr(logging.getLogger(name), "level", logging.WARNING)
    files = _files(tmp_path)
    code = main([_fill(word, files) for word in argv])
    out, err = capsys.readouterr()
    assert code == status, err
    assert "Traceback" not in out + err
    assert message in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lightning-mgpu") and "error:" in last, err  # the one line ending the command


def _fill(word: str, files: dict[str, str]) -> str:
    for name, path in files.items():
        word = word.replace("{" + name + "}", path)
    return word


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="missing a required argument"):
        main(["plan", "--module", "torch.nn:Linear", "--debug"])


def test_consolidate_creates_a_missing_parent_and_needs_no_safetensors_package(tmp_path, capsys, monkeypatch):
    """safetensors files are written by the package itself (``checkpoint/stream.py``): no package needed."""
    files = _files(tmp_path)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed: importing it fails
    out = tmp_path / "new" / "dir" / "model.safetensors"
    assert main(["consolidate", files["full.ckpt"], str(out), "--format", "safetensors"]) == 0
    assert "created the directory" in capsys.readouterr().out
    header = json.loads(out.read_bytes()[8 : 8 + int.from_bytes(out.read_bytes()[:8], "little")])
    assert header["w"]["shape"] == [2, 3]


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["pln"], []], ids=["help", "version", "typo", "none"])
def test_help_version_and_a_typo_import_neither_torch_nor_lightning(argv):
    script = (
        "import runpy, sys\n"
        f"sys.argv = ['lightning-mgpu', *{argv!r}]\n"
        "try:\n    runpy.run_module('lightning_mgpu.cli', run_name='__main__')\n"
        "except SystemExit as exit:\n    status = exit.code\n"
        "print('LOADED', sorted(m for m in ('torch', 'lightning', 'numpy') if m in sys.modules), file=sys.stderr)\n"
    )
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    command_s = time.perf_counter() - started
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], timeout=60)
    bare_s = time.perf_counter() - started
    assert "LOADED []" in result.stderr, f"{result.stderr}\n({command_s:.2f} s; `python -c pass`: {bare_s:.2f} s)"
    assert "Traceback" not in result.stderr


def _options() -> list[tuple[str, argparse.Action]]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    found = [("", action) for action in parser._actions]
    found += [(name, action) for name, sub in commands.items() for action in sub._actions]
    return [(name, action) for name, action in found if not isinstance(action, argparse._HelpAction)]


def test_every_option_has_help_and_shows_its_default_once():
    formatter = HelpFormatter("lightning-mgpu")
    for command, action in _options():
        if isinstance(action, argparse._SubParsersAction):
            continue
        where = f"lightning-mgpu {command} {'/'.join(action.option_strings) or action.dest}"
        assert action.help, f"{where} has no help text"
        assert formatter._expand_help(action).count("default") <= 1, f"{where} says its default twice"


def test_the_optional_packages_are_the_declared_extras():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for package, extra in EXTRAS.items():
        assert any(requirement.startswith(package) for requirement in extras.get(extra, ())), (package, extra)


@pytest.mark.parametrize(
    "argv",
    [
        case(["plan", "--module", "torch.nn:Linear"], id="module-not-a-lightning-module", slow=True),
        case(["plan", "--module", GPT, "--init-args", '{"n_layr": 2}'], id="init-args-typo", slow=True),
        case(["demo", "--zero-stage", "5"], id="zero-stage", slow=True),
        case(["demo", "--tensor-parallel-size", "3"], id="tp-3", slow=True),
        case(["inspect", "README.md"], id="inspect-not-a-checkpoint", slow=True),
    ],
)
def test_a_bad_input_as_a_fresh_process_prints_no_traceback(argv):
    """The in-process cases above, as users' commands in fresh processes (the slow tier)."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_mgpu.cli", *argv], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode in (1, 2), result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("lightning-mgpu"), result.stderr[-2000:]


def test_a_missing_optional_package_is_named_with_its_extra(monkeypatch, capsys):
    """The rehearsal examples need transformers: without it the message names `lightning-mgpu[examples]`."""
    import lightning_mgpu.cli.plan  # noqa: F401 - Lightning and torchmetrics first (torchmetrics imports transformers)

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "examples.rehearse.llama", raising=False)
    assert main(["plan", "--module", "examples.rehearse.llama:LlamaLM"]) == 2
    assert "needs the 'transformers' package, which is not installed: pip install 'lightning-mgpu[examples]'" in (
        capsys.readouterr().err
    )


def test_the_strategy_names_are_registered_when_lightning_comes_after_the_package():
    """``import lightning_mgpu`` loads nothing heavy; Lightning imported afterwards still knows "hybrid_zero2"."""
    script = (
        "import sys, lightning_mgpu\n"
        "assert 'torch' not in sys.modules\n"
        "import lightning as L\n"
        "trainer = L.Trainer(strategy='hybrid_zero2', accelerator='cpu', devices=2, logger=False)\n"
        "print(type(trainer.strategy).__name__, trainer.strategy.layout.zero_stage)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.stdout.strip().endswith("HybridStrategy 2"), result.stderr[-2000:]
