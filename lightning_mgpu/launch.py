"""Launching HybridStrategy's processes from a notebook or interactive session (fork)."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


class HybridMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, returning the *unsharded* weights to the main process."""

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self._start_method == "fork"

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        if self._start_method == "fork":
            # A forked child that uses the parent's already-started OpenMP pool can hang (a notebook has usually
            # run torch ops before `fit`): one intra-op thread per process is safe, and right when processes
            # share the machine's cores.
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
        super()._wrapping_function(process_idx, *args, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        strategy: Any = trainer.strategy  # a HybridStrategy
        state_dict = strategy.full_state_dict()  # collective: every rank takes part
        if strategy.global_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
