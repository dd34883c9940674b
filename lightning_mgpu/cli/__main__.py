"""``python -m lightning_mgpu.cli``: the ``lightning-mgpu`` command."""

import sys

from lightning_mgpu.cli import main

if __name__ == "__main__":  # imported, not run, by tools that import every module (the private-use scan)
    sys.exit(main())
