"""ZeRO stages 0-3 against their peers: ``python -m benchmarks.bench_peers --only <the ZeRO configurations> ...``."""

from __future__ import annotations

import os
import sys

from benchmarks import bench_peers

ZERO_CONFIGS = "ddp,zero0,deepspeed-zero1,zero1,deepspeed-zero2,zero2,fsdp2,zero3"

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = sys.argv[1:]
    bench_peers.main(argv if any(a.startswith("--only") for a in argv) else ["--only", ZERO_CONFIGS, *argv])
