"""``HybridStrategy``, the Lightning face of the package, over a few modules of its own:

- ``hybrid``: the strategy's Lightning hooks, delegating to the modules below;
- ``layout_choice``: the options and each candidate layout checked when the Trainer is built, the planner's choice
  at setup, agreed on by every rank;
- ``setup``: parallelizing the module and wiring the optimizers; ``step``: where a step runs (pipeline engine,
  tensor-parallel context);
- ``checkpoint_hooks`` and ``collectives``: the strategy's checkpoint and collective hooks (mixins).
"""

from lightning_mgpu.strategy.hybrid import HybridStrategy

__all__ = ["HybridStrategy"]
