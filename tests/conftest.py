"""Suite-wide settings."""

import torch

# The suite forks worker processes from this one (tests/helpers/distributed.py, the fork launcher). A forked child
# that uses an OpenMP pool the parent already warmed can hang, so compute here on one intra-op thread.
torch.set_num_threads(1)
