"""Suite-wide settings."""

import logging

import pytest
import torch

# The suite forks worker processes from this one (tests/helpers/distributed.py, the fork launcher). A forked child
# that uses an OpenMP pool the parent already warmed can hang, so compute here on one intra-op thread.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are collected everywhere (so they stay importable) and skipped without a CUDA device."""
    import pytest

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (python -m benchmarks.gpu_check runs these on a GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero")


@pytest.fixture(autouse=True)
def _lightning_process_state():
    """Each test starts as rank 0 with Lightning's loggers as configured: a test that builds a Trainer in this
    process as another rank (Lightning sets ``rank_zero_only.rank`` globally) or quiets a logger leaves neither to
    the tests after it in the same worker (their rank-zero messages vanished, depending on the order)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    ranks = [getattr(function, "rank", 0) for function in (rank_zero_only, fabric_rank_zero)]
    loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
    states = [(logger.level, logger.propagate, logger.disabled) for logger in loggers]
    yield
    for function, rank in zip((rank_zero_only, fabric_rank_zero), ranks):
        function.rank = rank
    for logger, (level, propagate, disabled) in zip(loggers, states):
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
