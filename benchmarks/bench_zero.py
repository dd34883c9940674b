"""ZeRO stages 0-3 against their peers: the data-parallel part of ``bench_peers.py`` (kept as a shortcut).

``python benchmarks/bench_zero.py [flags]`` = ``python benchmarks/bench_peers.py --only <the ZeRO configurations>
[flags]``. The launching, timing, probing and ratio table live in ``harness.py``; its names are re-exported here for
scripts written against this module.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import MB, QUIET_TRAINER, SEED, run_or_report, summarize  # noqa: E402, F401

ZERO_CONFIGS = "ddp,zero0,deepspeed-zero1,zero1,deepspeed-zero2,zero2,fsdp2,zero3"


def main(argv: Optional[list[str]] = None) -> None:
    from benchmarks import bench_peers

    argv = sys.argv[1:] if argv is None else argv
    bench_peers.main(argv if any(a.startswith("--only") for a in argv) else ["--only", ZERO_CONFIGS, *argv])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
