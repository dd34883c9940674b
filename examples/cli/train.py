"""Train the demo GPT from the command line with ``LightningCLI`` and ``HybridStrategy``.

From the repository root::

    python examples/cli/train.py fit --config examples/cli/hybrid_zero2.yaml
    python examples/cli/train.py fit --config examples/cli/hybrid_zero2.yaml --trainer.strategy=hybrid_zero1

Run as a script, ``HybridStrategy`` starts the other processes by re-running this same command (Lightning's
subprocess launcher), so keep the entry point under ``if __name__ == "__main__":``.
"""

from lightning.pytorch.cli import LightningCLI

import lightning_mgpu  # noqa: F401  (registers "hybrid", "hybrid_zero0".."hybrid_zero3" with Lightning)
from lightning_mgpu.demo import GPTLightningModule, TextDataModule


def main() -> None:
    # `overwrite=True`: the resolved config is saved as config.yaml in the run directory, and re-running the
    # example in the same directory should not abort because that file already exists.
    LightningCLI(GPTLightningModule, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
