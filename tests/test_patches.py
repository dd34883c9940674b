"""PatchLog and ModuleSnapshot on their own, in one process: what they undo and what they keep."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.patches import ModuleSnapshot, PatchLog


class _Swapped(nn.Linear):
    pass


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    return model


def test_snapshot_undoes_structure_and_keeps_objects_with_new_values() -> None:
    model = _model()
    first, last = model[0], model[2]
    weight, user_hook_calls = first.weight, []
    user_hook = first.register_forward_hook(lambda *_: user_hook_calls.append(1))  # the user's own: kept
    snapshot = ModuleSnapshot.take(model)

    # What parallelizing does: a class swap, hooks, a replaced parameter, a stand-in child, a gated forward, and
    # the attributes torch's composable APIs and our code add.
    first.__class__ = _Swapped
    first.register_forward_pre_hook(lambda *_: None)
    first.register_load_state_dict_post_hook(lambda *_: None)
    first.weight = nn.Parameter(torch.zeros(4, 4))
    model[2] = nn.Identity()
    last.forward = lambda x: x  # type: ignore[method-assign]
    vars(first)["_distribute_module_applied"] = True
    vars(first)["_lightning_mgpu_marker"] = 1
    vars(first)["user_cache"] = "kept"  # set by the user's own code during training: not ours to remove
    snapshot.release()
    assert weight.numel() == 0  # the original, no longer used, holds no memory while training

    trained = {name: value + 1 for name, value in _model().state_dict().items()}
    snapshot.restore(trained)
    assert type(first) is nn.Linear and model[2] is last and first.weight is weight
    assert "forward" not in vars(last) and "_distribute_module_applied" not in vars(first)
    assert "_lightning_mgpu_marker" not in vars(first) and vars(first)["user_cache"] == "kept"
    assert len(first._forward_pre_hooks) == 0 and len(first._load_state_dict_post_hooks) == 0
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained[name])
    model(torch.ones(1, 4)).sum().backward()
    assert user_hook_calls == [1] and weight.grad is not None
    user_hook.remove()  # the handle still works: hook dictionaries are restored in place
    assert len(first._forward_hooks) == 0


def test_patch_log_undoes_last_first() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    module = nn.Linear(2, 2)
    log = PatchLog()
    log.keep_attribute(optimizer, "zero_grad")
    optimizer.zero_grad = lambda *a, **k: None  # type: ignore[method-assign]
    log.set_attribute(module, "process_group", "dp")
    log.hook(module.register_forward_hook(lambda *_: None))
    order: list[str] = []
    log.add(lambda: order.append("first registered"))
    log.add(lambda: order.append("last registered"))
    log.undo()
    assert "zero_grad" not in vars(optimizer) and not hasattr(module, "process_group")
    assert len(module._forward_hooks) == 0 and order == ["last registered", "first registered"]
    log.undo()  # nothing left: a second teardown is harmless
