"""Suite-wide settings."""

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
