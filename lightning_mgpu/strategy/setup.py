"""What ``HybridStrategy.setup`` does around ``parallel.parallelize``: the example step the plans read, the user's
optimizers built on ranks that hold only frozen layers, and FSDP2's roots named and resharded.

Every patch on the user's objects goes into the run's ``PatchLog`` and is undone at ``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from lightning_mgpu._compat.fsdp import init_fsdp_root, reshard_fsdp
from lightning_mgpu.parallel.example import ExampleStep
from lightning_mgpu.parallel.pipeline import PipelineEngine


def example_step(trainer: Any, module: nn.Module, to_device: Callable[[Any], Any]) -> ExampleStep | None:
    """The user's training step on the first batch of the fit's training data, for the plans that read how the
    model is really called (``tp_plan="auto"``); the batch is fetched only if one asks. None outside ``fit``."""
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import CombinedLoader

    from lightning_mgpu._compat.lightning import fit_data_source

    if trainer.state.fn != TrainerFn.FITTING:
        return None
    source = fit_data_source(trainer)
    if not source.is_defined():
        return None

    def first_batch() -> Any:
        batch, _, _ = next(iter(CombinedLoader(source.dataloader(), "max_size_cycle")))
        return to_device(batch)

    return ExampleStep(module, "training_step", first_batch)


@contextmanager
def optimizers_of_frozen_stages(module: nn.Module, pipeline: PipelineEngine | None) -> Iterator[None]:
    """Around the user's ``configure_optimizers``: a pipeline rank holding only frozen layers (a frozen backbone's
    first blocks) builds the optimizer over an empty parameter list, which torch refuses. Within, on such a rank, an
    empty list becomes one empty parameter group: an optimizer that steps nothing until a parameter group is added
    (``BackboneFinetuning`` adding the stage's unfrozen layers). Elsewhere nothing changes."""
    if pipeline is None or any(p.requires_grad for p in module.parameters()):
        yield
        return
    init = Optimizer.__init__

    def empty_stage_init(self: Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        params = list(params)
        init(self, params or [{"params": []}], defaults)

    Optimizer.__init__ = empty_stage_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimizer.__init__ = init  # type: ignore[method-assign]


def reshard(roots: list[nn.Module]) -> None:
    """FSDP groups a step left unsharded (it raised between a forward's start and end) sharded again, so that the
    module holds the parameters the optimizer steps before the run hands them back. A no-op otherwise."""
    for root in roots:
        for sub in root.modules():
            if isinstance(sub, FSDPModule):
                # Mid-forward a group reshards only if set to: only ours, it is discarded next.
                sub.set_reshard_after_forward(True, recurse=False)
    shard_gathered(roots)


def name_fsdp_roots(roots: list[nn.Module]) -> None:
    """Each data-parallel root FSDP's root before anything runs: a submodule the user calls outside the step first
    (PPO's rollouts in its data loader, a callback sampling before training) would otherwise become a root of its
    own, and the step's forward be refused. Once the parameters hold their values."""
    for root in roots:
        init_fsdp_root(root)


def shard_gathered(roots: list[nn.Module]) -> None:
    """FSDP groups that keep their parameters gathered after a forward (the root's embeddings, norms and head; every
    group at ZeRO-2; FSDP2's replicate; a pipeline stage's last block, whose forward ends the stage by raising)
    sharded again, e.g. after ``trainer.validate``: a ``fit`` that reuses the parallel module then builds its
    optimizers on the sharded parameters, not on gathered copies that FSDP never reads or updates, and the module
    given back at teardown is the one the optimizers point at."""
    for root in roots:
        for sub in root.modules():
            reshard_fsdp(sub)
