"""``python -m lightning_mgpu.cli``: the ``lightning-mgpu`` command."""

import sys

from lightning_mgpu.cli import main

sys.exit(main())
