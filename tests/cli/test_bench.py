"""`lightning-mgpu bench`: bad input stops before any process starts; a small sweep ranks its layouts, shows the
scaling of the best one per device count and writes its files."""

from __future__ import annotations

import json
import logging

import pytest

from lightning_mgpu.cli import main

TINY = [
    "--module",
    "lightning_mgpu.demo:GPTLightningModule",
    "--datamodule",
    "lightning_mgpu.demo:TextDataModule",
    "--init-args",
    '{"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}',
    "--datamodule-args",
    '{"block_size": 32}',
]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--module", "no_such_package.mod:Model", "--devices", "2"], "cannot import 'no_such_package.mod'"),
        ([*TINY, "--devices", "0"], "argument --devices: must be a positive integer, got '0'"),
        ([*TINY, "--devices", "2", "--steps", "3", "--warmup-steps", "3"], "leaves no measured step"),
        ([*TINY, "--devices", "2", "--device-counts", "1,5"], "must lie in 1..2"),
        ([*TINY, "--devices", "2", "--init-args", "{n_layer: 2}"], "--init-args is not valid JSON"),
    ],
)
def test_bad_input_is_refused_before_any_run(flags, message, tmp_path, capsys):
    assert main(["bench", *flags, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.slow  # the slow tier: a user's command end to end (a fit per layout of the sweep)
def test_a_two_device_sweep_ranks_every_layout_and_reports_scaling(tmp_path, capsys):
    levels = {name: logging.getLogger(name).level for name in ("lightning.pytorch", "lightning.fabric")}
    code = main(
        [
            "bench",
            *TINY,
            "--devices",
            "2",
            "--steps",
            "4",
            "--warmup-steps",
            "1",
            "--batch-size",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    # Lightning's info lines were silenced for the sweep only (a test after it in this process reads them).
    assert {name: logging.getLogger(name).level for name in levels} == levels
    saved = json.loads((tmp_path / "bench.json").read_text())
    names = {(r["devices"], r["name"]) for r in saved["runs"]}
    assert names == {(1, "dp1_tp1_pp1"), (2, "dp2_tp1_pp1"), (2, "dp1_tp2_pp1"), (2, "dp1_tp1_pp2")}
    assert all(r["tokens_per_s"] > 0 for r in saved["runs"]), saved["runs"]
    assert all(sum(r["shares"].values()) == pytest.approx(1.0, rel=0.05) for r in saved["runs"])
    assert [row["devices"] for row in saved["scaling"]] == [1, 2] and saved["scaling"][0]["efficiency"] == 1.0
    assert "layouts ranked by measured throughput" in out and "efficiency" in out
    assert "theory 33%" in out  # the pipeline layout's bubble beside (p-1)/(m+p-1)
    assert (tmp_path / "bench.png").stat().st_size > 10_000
