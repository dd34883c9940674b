"""``HybridStrategy``, the Lightning face of the package, over a few modules of its own:

- ``hybrid``: the strategy's arguments, launch, setup and teardown hooks, delegating to the modules below;
- ``layout_choice``: the options and each candidate layout checked when the Trainer is built, the planner's choice
  at setup, agreed on by every rank;
- ``setup``: parallelizing the module and wiring the optimizers; ``step``: where a step runs (pipeline engine,
  tensor-parallel context) and the step, backward and optimizer-step hooks (a mixin);
- ``checkpoint_hooks`` and ``collectives``: the strategy's checkpoint and collective hooks (mixins).
"""

from lightning_mgpu.strategy.hybrid import HybridStrategy

__all__ = ["HybridStrategy"]
