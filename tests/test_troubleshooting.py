"""The troubleshooting page (docs/troubleshooting.md) quotes the package's messages verbatim: keep them in step.

Only the messages raised before any process starts are produced here (about a second); the others in the guide
(tp divisibility, checkpoints, ragged batches, failing ranks) need processes or files and were copied from real
runs.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest

from lightning_mgpu import HybridStrategy

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"


def _trainer(devices: int, **strategy_kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=HybridStrategy(**strategy_kwargs), logger=False)


CASES = {
    "sizes not dividing": lambda: _trainer(6, tensor_parallel_size=4),
    "sizes not multiplying": lambda: _trainer(4, tensor_parallel_size=2, data_parallel_size=4),
    "microbatches": lambda: _trainer(4, pipeline_parallel_size=4, num_microbatches=2),
    "stages_per_rank with 1F1B": lambda: HybridStrategy(pipeline_parallel_size=2, stages_per_rank=2),
    "stages_per_rank=1 looped": lambda: HybridStrategy(
        pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", stages_per_rank=1
    ),
    "sequence_parallel at tp=1": lambda: _trainer(2, sequence_parallel=True),
    "pipeline_schedule at pp=1": lambda: _trainer(2, pipeline_schedule="GPipe"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_guide_quotes_the_error(case):
    with pytest.raises(ValueError) as info:
        CASES[case]()
    quoted = f"{type(info.value).__name__}: {info.value}"
    assert quoted in GUIDE.read_text(), f"docs/troubleshooting.md does not quote the current message:\n{quoted}"


def test_guide_quotes_the_zero_stage_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(2, zero_stage=3, data_parallel_size=1, tensor_parallel_size=2)
    messages = [str(w.message) for w in caught if "zero_stage=3 shards" in str(w.message)]
    assert messages and messages[0] in GUIDE.read_text(), messages


def test_guide_quotes_the_refusal_of_restarts_on_torchruns_shared_store(monkeypatch):
    from lightning_mgpu.launch.elastic import ElasticStoreError, refuse_shared_store_restarts

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    with pytest.raises(ElasticStoreError) as info:
        refuse_shared_store_restarts()
    quoted = f"{type(info.value).__name__}: {info.value}"
    assert quoted in GUIDE.read_text(), f"docs/troubleshooting.md does not quote the current message:\n{quoted}"


def test_guide_quotes_the_bound_on_a_runs_start(monkeypatch):
    from lightning_mgpu.launch.startup import StartupBound

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr("time.monotonic", lambda: 100.0)  # 4 s into the start, as in the quoted run
    expired, sigterm = (StartupBound(4, rank, 3, lambda r: f"pp 0, dp {r}, tp 0") for rank in (0, 1))
    sigterm._started = 96.0
    # The rank whose bound expired, and one its launcher SIGTERMed meanwhile (threads not started: no ending).
    for line in (expired.message(4.0), sigterm._sigterm_message()):
        assert line in GUIDE.read_text(), f"docs/troubleshooting.md does not quote the current message:\n{line}"
