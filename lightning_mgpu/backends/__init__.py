"""Alternative engines for a parallel dimension, behind the same strategy and checkpoints (``zero_backend``)."""
