"""Benchmarks for lightning-mgpu; run them as scripts, e.g. ``python benchmarks/bench_peers.py``."""
