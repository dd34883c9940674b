"""Benchmarks for lightning-mgpu; run them as modules from the repository root, e.g.
``python -m benchmarks.bench_peers`` (the root is then on ``sys.path``: ``benchmarks`` and ``tests.helpers`` import).
"""
