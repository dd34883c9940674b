"""Lightning's weight-averaging callbacks beside sharded layouts: which layouts refuse them (``strategy/callbacks``),
and the averaged copy laid out as the parallelized module (``strategy/averaging``), in one gloo process. The
trained runs against DDP are conformance cells (``tests/test_lightning_features.py``), the checkpoints are in
``tests/test_checkpoint.py``."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.strategy.callbacks import check_callbacks
from tests.helpers.distributed import run_distributed


@pytest.mark.parametrize(
    "layout, options, ema_refused, swa_refused",
    [
        (ParallelLayout(2, 1, 1, 1), {}, False, False),
        (ParallelLayout(2, 1, 1, 3), {}, False, True),
        (ParallelLayout(1, 2, 1, 0), {}, False, True),
        (ParallelLayout(2, 2, 1, 3), {}, False, True),
        (ParallelLayout(1, 1, 2, 0), {}, True, True),
        (ParallelLayout(2, 1, 1, 2), {"zero_backend": "deepspeed"}, True, True),
        (ParallelLayout(4, 1, 1, 3, expert_parallel_size=2), {}, True, True),
    ],
    ids=["zero1", "zero3", "tp2", "dp2xtp2", "pp2", "deepspeed", "experts"],
)
def test_which_layouts_refuse_the_averaging_callbacks(layout, options, ema_refused, swa_refused):
    for callback, refused in (
        (EMAWeightAveraging(), ema_refused),
        (StochasticWeightAveraging(swa_lrs=0.1), swa_refused),
    ):
        if refused:
            with pytest.raises(ValueError, match="keeps a whole copy of the module"):
                check_callbacks([callback], layout, ParallelOptions(**options))
        else:
            check_callbacks([callback], layout, ParallelOptions(**options))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(2))


def _layout_the_copy() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.optim.swa_utils import AveragedModel

    from lightning_mgpu.patches import PatchLog
    from lightning_mgpu.strategy.averaging import _repoint_copy

    torch.manual_seed(0)
    module = _Tied()
    averaged = AveragedModel(module, use_buffers=True)
    own = dict(averaged.module.named_parameters(remove_duplicate=False))
    mesh = init_device_mesh("cpu", (1,))
    with torch.no_grad():
        module.mid.weight.add_(1.0)  # the module's weights were filled at setup: the copy takes the module's
    shared = nn.Parameter(distribute_tensor(module.embed.weight.detach(), mesh, [Shard(0)]))
    module.embed.weight = module.head.weight = shared
    module.mid.weight = nn.Parameter(distribute_tensor(module.mid.weight.detach(), mesh, [Replicate()]))
    patches = PatchLog()
    pairs = _repoint_copy(averaged.module, module, 0, patches)

    copy = averaged.module
    assert copy.head.weight is copy.embed.weight  # tied stays tied
    assert len(pairs) == 2  # one clone per distinct DTensor parameter
    for name, param in module.named_parameters():
        mine = copy.get_parameter(name)
        assert isinstance(mine, DTensor) == isinstance(param, DTensor), name
        if isinstance(param, DTensor):
            assert mine.placements == param.placements and not mine.requires_grad and mine is not param
        torch.testing.assert_close(
            mine.detach().full_tensor() if isinstance(mine, DTensor) else mine,
            param.detach().full_tensor() if isinstance(param, DTensor) else param,
        )
    assert copy.mid.bias is own["mid.bias"]  # plain in the module: left as it was

    averaged.update_parameters(module)  # torch pairs by position, elementwise on the shards
    with torch.no_grad():
        module.mid.weight.mul_(3.0)
    averaged.update_parameters(module)
    expected = module.mid.weight.detach().full_tensor() * (2 / 3)
    torch.testing.assert_close(copy.mid.weight.full_tensor(), expected)

    from lightning_mgpu.strategy.averaging import AveragedCopies

    copies = AveragedCopies()
    copies._originals = pairs
    copies.gather()
    patches.undo()  # the copy's own parameters back, holding the average
    assert copy.mid.weight is own["mid.weight"] and copy.head.weight is own["embed.weight"]
    torch.testing.assert_close(copy.mid.weight, expected)


def test_the_averaged_copy_is_laid_out_as_the_module_and_given_back_holding_the_average():
    run_distributed(_layout_the_copy, 1)
