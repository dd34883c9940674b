"""Contract tests of lightning_mgpu/_compat: each shim still does what the package relies on.

A failure names the internal and the version it was checked on (``_compat.changed``): update the shim, not the
callers. The distributed shims run in one forked gloo process of world size 1 (process groups and meshes).
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu import _compat
from lightning_mgpu._compat import amp, attention, c10d, data, dcp, dtensor, fake, fsdp, tensors
from lightning_mgpu._compat import lightning as lc
from tests.helpers.distributed import run_distributed


def _expect(condition: bool, what: str, package: str, detail: str) -> None:
    assert condition, _compat.changed(what, package, detail)


def test_an_internal_that_is_gone_fails_loudly_naming_it_and_the_version():
    with pytest.raises(_compat.InternalChanged, match=r"torch\.nn\._no_such_internal.*checked on torch 2\.13"):
        _compat.internal("torch.nn", "_no_such_internal")


def test_load_from_checkpoint_reads_a_directory_through_the_patched_loader(tmp_path):
    """``load_from_checkpoint`` opens its path through ``core.saving.pl_load`` (patched once, when Lightning loads
    beside this package); a directory the reader does not know goes on to Lightning's own loader."""
    import inspect

    from lightning.pytorch.core import saving

    assert "pl_load(checkpoint_path" in inspect.getsource(saving._load_from_checkpoint)
    assert getattr(saving.pl_load, "_lightning_mgpu_reads_directories", False)  # importing lightning_mgpu did it
    with pytest.raises(IsADirectoryError):  # not a sharded checkpoint: Lightning's own error
        saving.pl_load(tmp_path)


def test_amp_scaler_hooks_unscale_kernel_and_sparse_values():
    calls = []

    class Recording(amp.ScalerHooks):
        def unscale_grads(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            calls.append(float(inv_scale))
            return super().unscale_grads(optimizer, inv_scale, found_inf, allow_fp16)

    param = nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 8.0)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = Recording("cpu", init_scale=4.0)
    scaler.ensure_scale()
    _expect(scaler.get_scale() == 4.0, "GradScaler._lazy_init_scale_growth_tracker", "torch", "scale not initialised")
    scaler.unscale_locally(optimizer)
    _expect(calls == [0.25], "GradScaler._unscale_grads_", "torch", "unscale_ no longer calls it")
    _expect(torch.equal(param.grad, torch.full((3,), 2.0)), "GradScaler._unscale_grads_", "torch", "grads not unscaled")

    found = torch.zeros(1)
    grads = [torch.tensor([2.0, float("inf")])]
    amp.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    _expect(
        found.item() == 1.0 and grads[0][0].item() == 1.0,
        "torch._amp_foreach_non_finite_check_and_unscale_",
        "torch",
        "inf not found or not unscaled",
    )
    sparse = torch.sparse_coo_tensor([[0, 0]], [1.0, 2.0], (3,))  # uncoalesced: index 0 twice
    amp.sparse_values(sparse).mul_(2)
    _expect(sparse.coalesce().to_dense()[0].item() == 6.0, "Tensor._values", "torch", "not a view of the values")


def test_dcp_fqns_flattening_and_loading_without_a_process_group(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)))
    wrapped = next(name for name, _ in model.named_parameters())
    _expect(
        dcp.parameter_fqns(model, wrapped) == {"0.weight"},
        "state_dict._get_fqns",
        "torch",
        f"{wrapped!r} not mapped to '0.weight'",
    )
    flat, _ = dcp.flatten_state_dict({"model": {"w": torch.ones(2)}, "step": 3})
    _expect(set(flat) == {"model.w", "step"}, "_nested_dict.flatten_state_dict", "torch", f"keys {sorted(flat)}")

    import torch.distributed.checkpoint as tdcp

    state = {"model": {"w": torch.arange(4.0)}, "other": {"v": torch.ones(1)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state, checkpoint_id=tmp_path)
    loaded = dcp.load_without_process_group(tmp_path, keys={"model"})
    _expect(
        set(loaded) == {"model"} and torch.equal(loaded["model"]["w"], torch.arange(4.0)),
        "state_dict_loader._load_state_dict/_EmptyStateDictLoadPlanner",
        "torch",
        f"loaded {loaded}",
    )


def test_tensor_helpers():
    nested = {"a": [torch.ones(1), (torch.zeros(2), 3)]}
    _expect(
        len(tensors.tree_leaves(nested)) == 3 and len(tensors.tree_flatten(nested)[0]) == 3,
        "torch.utils._pytree",
        "torch",
        "leaves not found",
    )
    doubled = tensors.tree_map(lambda x: x * 2 if torch.is_tensor(x) else x, nested)
    _expect(doubled["a"][0].item() == 2.0 and doubled["a"][1][1] == 3, "torch.utils._pytree.tree_map", "torch", "")

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    model.register_buffer("mask", torch.ones(2), persistent=False)
    _expect(
        tensors.persistent_buffer_names(model) == ["0.running_mean", "0.running_var", "0.num_batches_tracked"],
        "nn.Module._non_persistent_buffers_set",
        "torch",
        str(tensors.persistent_buffer_names(model)),
    )

    source, holder = torch.nn.Linear(2, 2), torch.nn.Module()
    tensors.share_parameter_slots(holder, source)
    replacement = torch.nn.Parameter(torch.zeros(2, 2))
    holder.weight = replacement  # what a wrap does to the module it manages
    _expect(
        source.weight is replacement and [n for n, _ in holder.named_parameters()] == ["weight", "bias"],
        "nn.Module._parameters",
        "torch",
        "a parameter set on one module is not seen by the module sharing its slots",
    )
    strided = torch.randn(2, 3, requires_grad=True)
    out = tensors.contiguous_grad(strided)
    grad = torch.randn(3, 2).t()  # a strided gradient
    out.backward(grad)
    _expect(
        torch.equal(strided.grad, grad) and strided.grad.is_contiguous(),
        "torch.autograd.Function",
        "torch",
        "the gradient is not handed back contiguous",
    )

    seen = []

    class Mode(tensors.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.ones(2) + 1
    _expect(torch.ops.aten.add.Tensor in seen, "torch.utils._python_dispatch.TorchDispatchMode", "torch", f"{seen}")
    with tensors.fake_tensor_mode(allow_non_fake_inputs=True):
        fake = nn.Linear(4, 3)(torch.ones(2, 4))
    _expect(
        type(fake).__name__ == "FakeTensor" and fake.shape == (2, 3), "FakeTensorMode", "torch", type(fake).__name__
    )

    t = torch.zeros(2)
    before = tensors.version_counter(t)
    t.add_(1)
    _expect(tensors.version_counter(t) == before + 1, "Tensor._version", "torch", "not bumped by an in-place op")

    p = nn.Parameter(torch.ones(1))
    _expect(not tensors.has_post_accumulate_grad_hook(p), "Tensor._post_accumulate_grad_hooks", "torch", "")
    handle = p.register_post_accumulate_grad_hook(lambda _: None)
    _expect(tensors.has_post_accumulate_grad_hook(p), "Tensor._post_accumulate_grad_hooks", "torch", "hook not seen")
    handle.remove()

    linear = nn.Linear(2, 2)
    order = [n for n, _ in linear.named_parameters()]
    weight = linear.weight
    originals = tensors.swap_parameters(linear, {"weight": torch.zeros(2, 2)})
    _expect(
        torch.equal(linear(torch.ones(1, 2)), linear.bias.detach()[None].expand(1, 2))
        and originals["weight"] is weight,
        "nn.Module._parameters",
        "torch",
        "the swapped tensor is not what forward uses",
    )
    tensors.restore_parameters(linear, originals)
    _expect(
        linear.weight is weight and [n for n, _ in linear.named_parameters()] == order,
        "nn.Module._parameters",
        "torch",
        "not restored in order",
    )
    assert set(tensors.parameter_slots(linear)) == {"weight", "bias"}

    experts = nn.ModuleList([nn.Linear(1, 1) for _ in range(4)])
    tensors.set_children(experts, {"2": experts[2], "3": experts[3]})
    _expect([n for n, _ in experts.named_children()] == ["2", "3"], "nn.Module._modules", "torch", "children not set")

    model = nn.Sequential(nn.Linear(1, 1))
    model.register_buffer("scale", torch.ones(1))
    kept, hooks = tensors.module_structure(model), tensors.module_hooks(model)
    handle = model.register_forward_hook(lambda *_: None)
    _expect(
        tensors.module_hooks(model) != hooks and "_forward_hooks" in tensors.HOOK_ATTRIBUTES,
        "nn.Module._forward_hooks",
        "torch",
        f"a forward hook is not in {tensors.HOOK_ATTRIBUTES}",
    )
    model.add_module("1", nn.ReLU())
    model.scale = None
    tensors.set_module_hooks(model, hooks)
    tensors.set_module_structure(model, *kept)
    _expect(
        not model._forward_hooks
        and handle.id not in tensors.module_hooks(model)["_forward_hooks"]
        and [n for n, _ in model.named_children()] == ["0"]
        and model.scale is kept[2]["scale"],
        "nn.Module._modules/_parameters/_buffers/_forward_hooks",
        "torch",
        "the module tree not put back",
    )

    class Gathering(dict):  # like DeepSpeed ZeRO-3's parameter dict: reading through it has effects
        def __getitem__(self, key):
            raise AssertionError("read through the subclass")

        def items(self):
            raise AssertionError("read through the subclass")

    linear = nn.Linear(1, 1)
    weight = linear.weight
    linear.__dict__["_parameters"] = Gathering(linear.__dict__["_parameters"])
    tensors.plain_parameter_slots(linear)
    _expect(
        type(linear.__dict__["_parameters"]) is dict and linear.weight is weight,
        "nn.Module._parameters",
        "torch",
        "the parameter slots are not a plain dict with the same entries",
    )

    class Hooks:
        def hook(self, grad):
            return grad

    hooks, p = Hooks(), nn.Parameter(torch.ones(1))
    _expect(not tensors.has_backward_hook(p, hooks.hook), "Tensor._backward_hooks", "torch", "a hook seen on a new one")
    p.register_hook(hooks.hook)
    _expect(tensors.has_backward_hook(p, hooks.hook), "Tensor._backward_hooks", "torch", "a bound-method hook not seen")
    base = torch.ones(4)
    _expect(tensors.view_base(base[1:]) is base and tensors.view_base(base) is base, "Tensor._base", "torch", "")

    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(tensors.in_backward()))
    y.sum().backward()
    _expect(
        not tensors.in_backward() and seen == [True],
        "torch._C._current_graph_task_id",
        "torch",
        f"in backward: {seen}, outside: {tensors.in_backward()}",
    )


def test_fake_tensors_and_a_dispatch_mode_seeing_their_operators():
    seen = []

    class Seen(fake.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with fake.FakeTensorMode():
        weight = torch.empty(1 << 20, 1 << 12)  # 16 GiB: only its shape exists
        with Seen():
            out = weight.sum(0)
    _expect(out.shape == (1 << 12,) and type(out).__name__ == "FakeTensor", "FakeTensorMode", "torch", str(out))
    _expect(any(name.startswith("aten.sum") for name in seen), "TorchDispatchMode", "torch", str(seen))


def test_attention_implementation_of_a_hugging_face_config():
    from transformers import LlamaConfig

    config = LlamaConfig()
    config._attn_implementation = "eager"
    _expect(
        attention.attn_implementation(config) == "eager", "PretrainedConfig._attn_implementation", "transformers", ""
    )
    _expect(attention.attn_implementation(object()) is None, "attn_implementation", "transformers", "a plain object")


# Operator -> (outputs, index of the log-sum-exp among them): what fused_attention unpacks.
_ATTENTION_OUTPUTS = {
    "_scaled_dot_product_flash_attention_for_cpu": (2, 1),
    "_scaled_dot_product_flash_attention": (9, 1),
    "_scaled_dot_product_efficient_attention": (4, 1),
    "_scaled_dot_product_cudnn_attention": (9, 1),
}


def test_fused_attention_operators_and_their_schemas():
    """Every kernel's forward and backward exist on this torch with the arguments, in order, that the shim passes
    (the CUDA ones too: CPU builds register their schemas), and the forwards return the log-sum-exp where read."""
    assert set(attention.OPERATORS) == {"flash_cpu", "flash", "efficient", "cudnn"}
    for forward, backward in attention.OPERATORS.values():
        for name in (forward, backward):
            schema = attention.operator(name).default._schema
            names = tuple(argument.name for argument in schema.arguments)
            _expect(names == attention.ARGUMENTS[name], f"torch.ops.aten.{name}", "torch", f"arguments {names}")
        outputs, lse = _ATTENTION_OUTPUTS[forward]
        returns = attention.operator(forward).default._schema.returns
        _expect(len(returns) == outputs, f"torch.ops.aten.{forward}", "torch", f"{len(returns)} outputs")
        _expect("sumexp" in returns[lse].name, f"torch.ops.aten.{forward}", "torch", f"output {lse}: {returns[lse]}")
    with pytest.raises(AttributeError, match=r"torch\.ops\.aten\._no_such_attention.*checked on torch"):
        attention.operator("_no_such_attention")


def test_fused_cpu_attention_against_sdpa_and_the_log_sum_exp():
    """The CPU kernel through the shim: SDPA's output, the log-sum-exp of the scaled scores, and autograd's
    gradients from its backward, causal and not, with grouped-query heads."""
    g = torch.Generator().manual_seed(0)
    for causal in (True, False):
        q, k, v = (torch.randn(2, h, 6, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
        grad = torch.randn(2, 4, 6, 8, generator=g)
        out, lse = attention.fused_attention("flash_cpu", q.detach(), k.detach(), v.detach(), causal, 0.5)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=0.5, enable_gqa=True
        )
        scores = q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-2, -1) * 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(out, expected.detach())
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
        _expect(lse.dtype == torch.float32, "_scaled_dot_product_flash_attention_for_cpu", "torch", str(lse.dtype))
        grads = attention.fused_attention_backward("flash_cpu", grad, q.detach(), k.detach(), v.detach(), out, lse,
                                                   causal, 0.5)  # fmt: skip
        for mine, theirs in zip(grads, torch.autograd.grad(expected, (q, k, v), grad)):
            torch.testing.assert_close(mine, theirs)
    with pytest.raises(ValueError, match="No fused attention kernel 'other'"):
        attention.fused_attention("other", q, k, v, True, None)


def test_the_memory_efficient_kernels_log_sum_exp_padding():
    """Its backward reads rows padded to a multiple of 32 queries with +inf, as its forward writes them."""
    padded = attention._padded_rows(torch.zeros(2, 3, 40), 32)
    assert padded.shape == (2, 3, 64) and padded.is_contiguous()
    assert torch.equal(padded[..., :40], torch.zeros(2, 3, 40)) and bool(padded[..., 40:].isinf().all())
    assert attention._padded_rows(torch.zeros(1, 1, 64), 32).shape == (1, 1, 64)


def test_dataloader_with_another_sampler():
    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2)
    clone = data.with_sampler(loader, "batch_sampler", [[4, 5], [0, 1]])
    _expect([b.tolist() for b in clone] == [[4, 5], [0, 1]], "DataLoader._iterator", "torch", "clone not re-sampled")
    _expect([b.tolist() for b in loader][0] == [0, 1], "DataLoader._iterator", "torch", "original changed")


def _distributed_contract() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    out: dict = {}
    strided = distribute_tensor(torch.arange(8.0), mesh, [dtensor.strided_shard(0, 2)])
    out["strided"] = (
        dtensor.is_strided_shard(strided.placements[0]),
        dtensor.strided_chunks(strided.placements[0]),
        dtensor.strided_chunks(Shard(0)),
        torch.equal(strided.full_tensor(), torch.arange(8.0)),
    )

    calls = []

    class Style(dtensor.StyleHooks, ColwiseParallel):
        def apply_style(self, module, device_mesh):
            calls.append("apply")
            return super().apply_style(module, device_mesh)

        def prepare_output(self, module, outputs, device_mesh):
            calls.append("output")
            return super().prepare_output(module, outputs, device_mesh)

    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    expected = linear(torch.ones(1, 3))
    parallelize_module(linear, mesh, Style())
    got = linear(torch.ones(1, 3))
    out["style"] = (calls == ["apply"], isinstance(linear.weight, DTensor), torch.allclose(got, expected))
    split = dtensor.unflatten_mesh(mesh, "dp", (1, 1), ("replica", "ep"))
    out["unflatten"] = split.mesh_dim_names == ("replica", "ep")
    two = init_device_mesh("cpu", (1, 1), mesh_dim_names=("outer", "inner"))
    flat = dtensor.flatten_mesh(two, ("outer", "inner"), "both")
    out["flatten"] = (flat.mesh_dim_names == ("both",), two["both"].size() == 1)

    ddp = nn.Linear(2, 2)
    fsdp.replicate_ddp(ddp, process_group=mesh.get_group())
    shared = nn.Linear(2, 2)
    fsdp.replicate_with_fsdp(shared, mesh=mesh)
    out["fsdp"] = (fsdp.is_ddp_replicated(ddp), not fsdp.is_ddp_replicated(shared), isinstance(shared.weight, DTensor))
    out["unapply"] = [_reapplies(mesh, forget) for forget in (False, True)]
    out["root"] = [_root_named_first(mesh, name) for name in (False, True)]
    out["reshard"] = [_resharded_after_a_raised_forward(mesh, helper) for helper in (False, True)]
    out["follow"] = [_followed_into_backward(mesh, hook) for hook in (False, True)]
    out["prepare"] = []
    for find_unused in (True, False):  # manual optimization: the backward runs inside the replicated module's forward
        inside = _BackwardInside(use_spare=not find_unused)
        fsdp.replicate_ddp(inside, process_group=mesh.get_group(), find_unused_parameters=find_unused)
        for _ in range(3):  # each forward checks the last one's reduction; the buckets are rebuilt in the second
            inside(torch.ones(1, 2))
        ddp = fsdp.ddp_of(inside)
        spare_grad = inside.spare.weight.grad
        out["prepare"] += [ddp is not None and fsdp.reducer_finalized(ddp), (spare_grad is None) == find_unused]

    group = mesh.get_group()
    out["c10d"] = (
        c10d.group_name(group) == group.group_name,
        hasattr(c10d.functional_collectives(), "all_reduce"),
        c10d.pipelining_p2p() is not None,
        hasattr(c10d.FUNCTIONAL_OPS, "all_reduce"),
    )
    store = c10d.default_store()
    out["store"] = (
        store.add("contract/votes", 1) == 1 and store.add("contract/votes", 0) == 1,
        bytes(store.compare_set("contract/decision", "", "first")) == b"first",  # absent: set
        bytes(store.compare_set("contract/decision", "", "second")) == b"first",  # present: kept, returned
        store.check(["contract/decision"]) and not store.check(["contract/absent"]),
    )
    summed = c10d.all_reduce(torch.ones(2), "sum", mesh)
    leaf = torch.ones(2, requires_grad=True)
    reduced = DTensor.from_local(leaf, mesh, [Replicate()], run_check=False) * 2  # fresh, as a collective's result
    local = dtensor.owned_local(reduced)
    local.add_(1)  # what to_local()'s view refuses
    local.sum().backward()
    out["owned"] = (
        type(summed) is torch.Tensor and torch.equal(summed, torch.ones(2)),
        type(local) is torch.Tensor,
        torch.equal(local.detach(), torch.full((2,), 3.0)),
        torch.equal(leaf.grad, torch.full((2,), 2.0)),
    )
    first = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    _ = distribute_tensor(torch.ones(4), first, [Shard(0)]) * 2  # cached with `first`
    second = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    on_second = distribute_tensor(torch.ones(4), second, [Shard(0)])
    stale = (on_second * 2).device_mesh is first  # why the shim exists: the cached spec holds the first mesh
    dtensor.forget_meshes()
    out["forget"] = (stale, (on_second * 2).device_mesh is second)
    out["lightning"] = (
        lc.sync_ddp_if_available(torch.ones(1), None, reduce_op="sum").item(),
        lc.all_gather_ddp_if_available(torch.ones(1)).shape,
    )
    out["box"] = dtensor.local_box(distribute_tensor(torch.ones(4, 2), mesh, [Shard(1)]))
    out["hf_files"] = _hf_files_assembled()
    return out


def _hf_files_assembled() -> bool:
    """DCP's Hugging Face writer's slices assembled into safetensors files and their index by the shim."""
    import json
    import tempfile
    from pathlib import Path

    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}
    with tempfile.TemporaryDirectory() as root:
        slices, out = Path(root, "slices"), Path(root, "out")
        plan = {"a": 1, "b": 2}
        out.mkdir()
        tdcp.save(state, storage_writer=HuggingFaceStorageWriter(str(slices), plan, save_distributed=True))
        dcp.consolidate_safetensors_on_every_rank(slices, out, plan)
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        loaded = {**load_file(out / index["a"]), **load_file(out / index["b"])}
    return set(index) == {"a", "b"} and all(torch.equal(loaded[k], v) for k, v in state.items())


class _BackwardInside(nn.Module):
    """A step whose backward runs inside the forward (``manual_backward`` in ``training_step``); ``spare`` unused
    unless ``use_spare``."""

    def __init__(self, use_spare: bool) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(2, 1), nn.Linear(2, 1)
        self.use_spare = use_spare

    def forward(self, x):
        loss = self.used(x).sum() + (self.spare(x).sum() if self.use_spare else 0)
        fsdp.prepare_ddp_backward(self, loss)
        loss.backward()
        fsdp.skip_ddp_post_forward_reduction(self)
        return loss


def _root_named_first(mesh, name: bool) -> bool:
    """A unit's own forward before its root's: refused by FSDP2 unless ``init_fsdp_root`` named the root first."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if name:
        fsdp.init_fsdp_root(model)
    with torch.no_grad():
        model[0](torch.ones(1, 2))
    try:
        model(torch.ones(1, 2)).sum().backward()
    except RuntimeError as error:
        return "already been lazily initialized" not in str(error)
    return True


def _resharded_after_a_raised_forward(mesh, helper: bool) -> bool:
    """A forward left by an exception (a pipeline stage's end) keeps FSDP2's group gathered through ``reshard()``;
    ``reshard_fsdp`` registers the sharded parameters again."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    class Stop(Exception):
        pass

    model = nn.Linear(2, 2)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    run = model.forward

    def raising(x):
        run(x)
        raise Stop

    model.forward = raising
    try:
        model(torch.ones(1, 2))
    except Stop:
        pass
    if helper:
        fsdp.reshard_fsdp(model)
    else:
        model.reshard()
    return isinstance(model.weight, DTensor)


class _Actor(nn.Module):
    """PPO's actor: its forward returns a ``Categorical``, whose tensors FSDP2 does not look into."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.net(x))


def _followed_into_backward(mesh, hook: bool) -> bool:
    """A ZeRO-3 unit returning a distribution: its weight gets the gradient a plain copy gets only with
    ``follow_into_backward`` hooked on the distribution's logits (else it gets none)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    root = nn.Module()
    root.actor = _Actor()
    plain = _Actor()
    plain.load_state_dict(root.actor.state_dict())
    x, action = torch.ones(4, 2), torch.tensor([0, 1, 2, 1])
    (-plain(x).log_prob(action).mean()).backward()
    fully_shard(root.actor, mesh=mesh, reshard_after_forward=True)
    fully_shard(root, mesh=mesh)
    fsdp.init_fsdp_root(root)
    pi = root.actor(x)
    if hook:
        fsdp.follow_into_backward(root.actor, [pi.logits])
    try:
        (-pi.log_prob(action).mean()).backward()
    except RuntimeError:
        return False
    grad = root.actor.net.weight.grad
    return isinstance(grad, DTensor) and torch.allclose(grad.full_tensor(), plain.net.weight.grad)


def _reapplies(mesh, forget: bool) -> bool:
    """``fully_shard`` applies again to a module put back by hand, with its composable state forgotten or not."""
    from torch.distributed.fsdp import fully_shard

    module = nn.Linear(2, 2)
    cls, keys, params = type(module), set(vars(module)), dict(module.named_parameters())
    fully_shard(module, mesh=mesh)
    added = set(vars(module)) - keys
    assert added and all(fsdp.is_torch_added_attribute(name) for name in added), _compat.changed(
        "attributes fully_shard sets", "torch", f"unknown: {sorted(added)}"
    )
    module.__class__ = cls
    for name in added:
        del vars(module)[name]
    if forget:
        fsdp.forget_composable_state(module)
    module.register_parameter("weight", params["weight"])
    module.register_parameter("bias", params["bias"])
    try:
        fully_shard(module, mesh=mesh)
    except AssertionError:
        return False
    return True


def test_distributed_shims_in_a_process_group():
    out = run_distributed(_distributed_contract, 1)[0]
    _expect(out["strided"] == (True, 2, 1, True), "placement_types._StridedShard", "torch", str(out["strided"]))
    _expect(out["style"][0], "ParallelStyle._apply", "torch", "parallelize_module no longer calls it")
    _expect(all(out["style"][1:]), "ColwiseParallel._prepare_input_fn/_prepare_output_fn", "torch", str(out["style"]))
    _expect(out["unflatten"], "DeviceMesh._unflatten", "torch", "dimension names differ")
    _expect(all(out["flatten"]), "DeviceMesh._flatten", "torch", str(out["flatten"]))
    _expect(all(out["fsdp"]), "torch.distributed._composable.replicate(_with_fsdp)", "torch", str(out["fsdp"]))
    _expect(
        all(out["prepare"]),
        "overrides.distributed.prepare_for_backward/require_backward_grad_sync/Reducer._check_reducer_finalized",
        "lightning",
        f"(finalized after backwards inside the forward, the spare layer's gradient) searching, not: {out['prepare']}",
    )
    _expect(
        out["unapply"] == [False, True],
        "_composable_state._module_state_mapping",
        "torch",
        f"fully_shard applied again without/with forgetting: {out['unapply']}",
    )
    _expect(
        out["reshard"] == [False, True],
        "FSDPParamGroup._training_state",
        "torch",
        f"sharded again after a raised forward, by reshard()/reshard_fsdp: {out['reshard']}",
    )
    _expect(
        out["follow"] == [False, True],
        "FSDPState._pre_backward",
        "torch",
        f"a unit's weight given its gradient through a distribution it returns, without/with the hook: {out['follow']}",
    )
    _expect(
        out["root"] == [False, True],
        "FSDPState._lazy_init",
        "torch",
        f"a unit's forward before the root's, without/with the root named first: {out['root']}",
    )
    _expect(
        all(out["c10d"]), "_functional_collectives/_resolve_group_name/schedules._batch_p2p", "torch", str(out["c10d"])
    )
    _expect(
        all(out["store"]),
        "distributed_c10d._get_default_store (add, compare_set, check)",
        "torch",
        f"(add, compare_set absent, compare_set present, check): {out['store']}",
    )
    _expect(all(out["forget"]), "DTensor sharding caches", "torch", f"(stale before, fresh after): {out['forget']}")
    _expect(
        all(out["owned"]),
        "_functional_collectives.all_reduce/DTensor._spec/_local_tensor",
        "torch",
        f"(all_reduce, owned_local plain, its values, its gradient): {out['owned']}",
    )
    _expect(out["box"] == (0, 0), "_utils.compute_local_shape_and_global_offset", "torch", str(out["box"]))
    _expect(out["hf_files"], "_consolidate_hf_safetensors.consolidate_safetensors_files_on_every_rank", "torch", "")
    _expect(
        out["lightning"] == (1.0, torch.Size([1, 1])),
        "_sync_ddp_if_available/_all_gather_ddp_if_available",
        "lightning",
        str(out["lightning"]),
    )


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2)


def test_sigterm_notifier_without_its_broadcast():
    import signal

    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    connector = trainer._signal_connector
    before = signal.getsignal(signal.SIGTERM)
    connector.register_signal_handlers()
    try:
        handlers = signal.getsignal(signal.SIGTERM).signal_handlers
        undo = lc.quiet_sigterm_notifier(trainer)
        _expect(undo is not None, "_SignalConnector._sigterm_notifier_fn", "lightning", "not among the handlers")
        replaced = [h for h in handlers if getattr(h, "__func__", None) is type(connector)._sigterm_notifier_fn]
        _expect(not replaced, "_HandlersCompose.signal_handlers", "lightning", "the notifier is still called")
        handlers[0](signal.SIGTERM, None)  # no process group: what is left of the notifier runs alone
        _expect(connector.received_sigterm, "_SignalConnector.received_sigterm", "lightning", "not set")
        undo()
        restored = [h for h in handlers if getattr(h, "__func__", None) is type(connector)._sigterm_notifier_fn]
        _expect(len(restored) == 1, "_HandlersCompose.signal_handlers", "lightning", "not put back")
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, before)


def test_lightning_internals(tmp_path):
    for cls, hooks in (
        (lc.SubprocessScriptLauncher, ("_call_children_scripts",)),
        (lc.MultiProcessingLauncher, ("_wrapping_function", "_collect_rank_zero_results")),
        (lc.ChildProcessObserver, ("_run",)),
    ):
        for hook in hooks:
            _expect(callable(getattr(cls.__mro__[1], hook, None)), f"{cls.__mro__[1].__name__}.{hook}", "lightning", "")
    observer = lc.ChildProcessObserver(main_pid=0, child_processes=[], sleep_period=1)
    _expect(
        observer.child_processes == [] and observer.check_children() is True,
        "_ChildProcessObserver._run",
        "lightning",
        "",
    )
    _expect(lc.WorkerOutput._fields[:2] == ("best_model_path", "weights_path"), "_WorkerOutput", "lightning", "")
    _expect(
        lc.convert_fp_tensor(torch.ones(1), torch.float16).dtype == torch.float16, "_convert_fp_tensor", "lightning", ""
    )
    with lc.DtypeContextManager(torch.float16):
        _expect(torch.empty(1).dtype == torch.float16, "_DtypeContextManager", "lightning", "")
    _expect(
        lc.optimizer_handles_unscaling(torch.optim.SGD([nn.Parameter(torch.ones(1))])) is False,
        "_optimizer_handles_unscaling",
        "lightning",
        "",
    )

    model = _Tiny()
    mesh = object()
    lc.set_device_mesh(model, mesh)
    _expect(model.device_mesh is mesh, "LightningModule._device_mesh", "lightning", "device_mesh reads elsewhere")
    lc.set_device_mesh(model, None)
    _expect(
        lc.attached_trainer(model) is None and lc.attached_trainer(nn.Linear(1, 1)) is None,
        "LightningModule._trainer",
        "lightning",
        "",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        sync_batchnorm=True,
        strategy="ddp",
        devices=1,
    )
    _expect(lc.layer_sync(trainer.strategy) is not None, "Strategy._layer_sync", "lightning", "sync_batchnorm lost")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    fetchers = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            fetchers.append(lc.fetcher_profiler_hooks(lc.fit_data_fetcher(trainer)))

        def on_before_optimizer_step(self, trainer, *args):
            fetchers.append("hook")

    trainer.callbacks.append(Probe())
    trainer.fit(model)
    _expect(lc.attached_trainer(model) is trainer, "LightningModule._trainer", "lightning", "")
    _expect(
        fetchers[0] is not None and all(callable(h) for h in fetchers[0]),
        "_DataFetcher._start_profiler/_stop_profiler",
        "lightning",
        str(fetchers),
    )
    _expect(lc.fit_data_source(trainer).is_defined(), "_FitLoop._data_source", "lightning", "")
    fetchers.clear()
    lc.call_callback_hooks(trainer, "on_before_optimizer_step", trainer.optimizers[0])
    _expect(fetchers == ["hook"], "trainer.call._call_callback_hooks", "lightning", str(fetchers))
    lc.call_lightning_module_hook(trainer, "on_before_optimizer_step", trainer.optimizers[0])
    lc.after_closure(trainer.precision_plugin, model, trainer.optimizers[0])
    _expect(fetchers == ["hook", "hook"], "Precision._after_closure", "lightning", str(fetchers))
    lc.reset_optimizers_and_schedulers(trainer.strategy)
    _expect(trainer.strategy.optimizers == [], "Strategy._reset_optimizers_and_schedulers", "lightning", "")
    _expect(isinstance(lc.IS_INTERACTIVE, bool), "_IS_INTERACTIVE", "lightning", "")


def test_weight_averaging_internals():
    """``WeightAveraging``'s ``_average_model`` (built in ``setup``), ``_device``, and the methods its hooks call
    through the instance (``strategy/averaging.py`` lays out the copy and guards these): the average's
    ``update_parameters`` after a step, ``_swap_models`` around validation, ``_copy_average_to_current`` at the end;
    the swap pairs ``parameters()`` then ``buffers()`` by position."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import EMAWeightAveraging
    from torch.optim.swa_utils import AveragedModel

    callback, model = EMAWeightAveraging(decay=0.5), _Tiny()
    _expect(lc.weight_averaging_copy(callback) is None, "WeightAveraging._average_model", "lightning", "set early")
    _expect(lc.weight_averaging_device(callback) is None, "WeightAveraging._device", "lightning", "")
    callback.setup(None, model, "fit")
    averaged = lc.weight_averaging_copy(callback)
    _expect(isinstance(averaged, AveragedModel), "WeightAveraging._average_model", "lightning", str(type(averaged)))
    calls = []
    for name, method in lc.weight_averaging_transfers(callback).items():
        setattr(callback, name, lambda *args, name=name, method=method: (calls.append(name), method(*args)))
    update = averaged.update_parameters
    averaged.update_parameters = lambda module: (calls.append("update"), update(module))
    trainer = SimpleNamespace(global_step=1, current_epoch=0)
    callback.on_train_batch_end(trainer, model, None, None, 0)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    before = [p.detach().clone() for p in model.parameters()]
    callback.on_validation_epoch_start(trainer, model)
    swapped = [p.detach().clone() for p in model.parameters()]
    callback.on_validation_epoch_end(trainer, model)
    callback.on_train_end(trainer, model)
    _expect(
        calls == ["update", "_swap_models", "_swap_models", "_copy_average_to_current"],
        "WeightAveraging's hooks",
        "lightning",
        str(calls),
    )
    _expect(
        not torch.equal(swapped[0], before[0]) and torch.equal(swapped[1], before[1]),
        "WeightAveraging._swap_models",
        "lightning",
        "no longer pairs parameters by position",
    )


def test_lightning_hands_the_strategy_a_plugin_that_names_its_precision():
    """``HybridPrecision.handed_over`` reads only the plugin Lightning built (its public ``precision``; no call
    stack). On CPU Lightning turns ``"16-mixed"`` into ``"bf16-mixed"`` and warns: that is what runs, and if
    Lightning stops doing so, this says so (fp16 on CPU then needs no explicit plugin any more)."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    from lightning_mgpu import HybridPrecision, HybridStrategy

    plugins = [
        (Precision(), "32-true"),
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
        (MixedPrecision("16-mixed", "cpu"), "16-mixed"),
        (HalfPrecision("bf16-true"), "bf16-true"),
        (DoublePrecision(), "64-true"),
    ]
    for plugin, name in plugins:
        _expect(plugin.precision == name, f"{type(plugin).__name__}.precision", "lightning", repr(plugin.precision))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision="16-mixed",
            strategy=HybridStrategy(),
            logger=False,
            enable_checkpointing=False,
        )
    plugin = trainer.strategy.precision_plugin
    _expect(
        isinstance(plugin, HybridPrecision) and plugin.precision == "bf16-mixed",
        "Trainer(accelerator='cpu', precision='16-mixed') runs bf16-mixed",
        "lightning",
        f"the strategy got {plugin.precision}",
    )
    _expect(
        any("Using `precision='bf16-mixed'` instead" in str(w.message) for w in caught),
        "the accelerator connector's warning about 16-mixed on CPU",
        "lightning",
        "no warning",
    )


def test_deepspeed_fragment_mappings_and_state_linking():
    """The DeepSpeed internals behind ``_compat.deepspeed`` exist; the shim reads and relinks through them (the
    DeepSpeed backend's checkpoint tests exercise them on a real engine)."""
    pytest.importorskip("deepspeed")
    from lightning_mgpu._compat import deepspeed as ds

    ds.check()
    param = torch.nn.Parameter(torch.zeros(2))
    assert not ds.has_fragment_mapping(param) and ds.fragment_mapping(param) is None
    param._hp_mapping = None  # what DeepSpeed sets on a parameter outside this rank's partition
    assert ds.has_fragment_mapping(param) and ds.fragment_mapping(param) is None

    class Linking:
        _hp_optimizer_states_linked = True
        calls = 0

        def _lazy_init_hp_params_optimizer_state(self) -> None:
            self.calls += 1
            assert self._hp_optimizer_states_linked is False  # DeepSpeed links only when the flag says not yet

    zero = Linking()
    ds.relink_optimizer_states(zero)
    ds.relink_optimizer_states(None)
    assert zero.calls == 1


def test_pipelining_schedule_actions_are_torchs_order():
    """``get_schedule_ops`` builds a multi-stage schedule's order with mock stages: each stage's forward and backward
    of each microbatch once, the stages placed as the schedule places them."""
    from lightning_mgpu._compat import pipelining

    for schedule, parts in (("Interleaved1F1B", ("F", "B")), ("ZBVZeroBubble", ("F", "I", "W"))):
        ranks = [
            [part for action in actions for part in (action if isinstance(action, list) else [action])]
            for actions in pipelining.schedule_actions(schedule, 2, 4, 2)
        ]
        flat = [part for actions in ranks for part in actions]
        assert sorted(flat) == sorted((kind, stage, m) for kind in parts for stage in range(4) for m in range(4))
        stages = [{stage for _, stage, _ in actions} for actions in ranks]
        placed = [{0, 2}, {1, 3}] if schedule == "Interleaved1F1B" else [{0, 3}, {1, 2}]
        _expect(stages == placed, "_schedule_visualizer.get_schedule_ops", "torch", f"{schedule} places {stages}")
