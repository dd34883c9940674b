"""Pipeline parallelism for unmodified models, run by torch.distributed.pipelining schedules.

The model is not rewritten or traced. Each rank keeps the blocks of its stages (the others are replaced by
parameter-free stand-ins), and a stage runs the user's *whole* network call with three interceptions:

- modules before the blocks (embeddings) exist only on the first stage; elsewhere a placeholder returns zeros of
  the right shape (computed on the meta device), which the stage then ignores;
- the stage's first block takes the activation received from the previous stage instead of its input;
- the stage's last block ends the call by raising ``_StageDone`` with its output, except on the last stage, whose
  call runs to the end (norm, head) and returns the network's real output. (An exception, because the rest of the
  user's network code must not run on this stage and only raising leaves it; nothing else uses one.)

Because every rank of a pipeline reads the same batch, each stage knows the network call's arguments for every
microbatch (captured by running the user's step up to the network call): position ids, masks and rotary
embeddings are computed as usual on every stage.

Only the activation passes from stage to stage, so nothing else a later stage computes may depend on the stand-ins'
values: each later stage's first forward checks that (``pipeline_standins``) and refuses a model whose blocks also
take the embeddings or other stages' outputs.

Everything the split does to the user's module (stand-ins in place of other ranks' modules, the gate on each kept
block's ``forward``) is recorded and undone by ``PipelineRuntime.unsplit``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_mgpu._compat.tensors import contiguous_grad, share_parameter_slots, tree_leaves
from lightning_mgpu.layout import PP_AXIS
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.blocks import block_at
from lightning_mgpu.parallel.pipeline.carry import CarriedValues, CarryKey
from lightning_mgpu.parallel.pipeline.plan import PipelineSplit, plan_split, stage_indices, stage_owner, stages_per_rank
from lightning_mgpu.parallel.pipeline.standins import (
    ArgumentRecorder,
    PassThrough,
    Placeholder,
    Unreachable,
    ValueCheck,
    first_input,
    keep_tied_names,
    marked,
    replace_module,
)
from lightning_mgpu.parallel.pipeline.ties import TiedGradients, find_cross_stage_ties

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _StageDone(Exception):
    """Raised by a non-last stage's last block to end the network call with that block's output."""

    def __init__(self, output: object) -> None:
        super().__init__()
        self.output = output


@dataclass
class NetworkCall:
    """The user's network call for one microbatch, captured from its step."""

    module: nn.Module
    args: tuple
    kwargs: dict


class Stage(nn.Module):
    """One pipeline stage: owns (as submodules) exactly its parameters; runs the captured network call.

    The schedule scales and the data-parallel wrap shards ``self.parameters()``, so a stage must own its
    parameters and no others, even when one rank runs two stages of one model.
    """

    def __init__(self, runtime: PipelineRuntime, index: int, blocks: list[nn.Module], ends: list[nn.Module]) -> None:
        super().__init__()
        self._runtime = [runtime]  # not a submodule
        self.index = index
        self.block_range = runtime.split.blocks_of(index)
        self.blocks = list(blocks)
        self.owned = nn.ModuleList([*blocks, *ends])
        self.inferring = False  # set while torch's pipelining infers shapes with a trial forward
        # Whether this stage's output was checked not to depend on the stand-ins' values (see ``pipeline_standins``);
        # the first stage has nothing to check: it computes everything before its blocks itself.
        self.values_checked = index == 0
        # Per-microbatch state, set on every forward: kept off nn.Module.__setattr__, whose Parameter and buffer
        # checks cost more than the rest of this method.
        self._progress = _StageProgress()

    @property
    def runtime(self) -> PipelineRuntime:
        return self._runtime[0]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.runtime.num_stages - 1

    @property
    def received(self) -> torch.Tensor | None:
        """The activation from the previous stage during this stage's forward (None on the first stage)."""
        return self._progress.received

    def forward(self, x: torch.Tensor, *received: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``x``: the activation (on the first stage a placeholder); ``received``: the values later stages take from
        the first stage besides it (``carry.py``)."""
        progress = self._progress
        if self.inferring:
            microbatch = 0  # a shape-inference trial: run microbatch 0, count nothing, keep nothing
        else:
            # Schedules run a stage's forwards in microbatch order: count them (stage 0's input is a placeholder,
            # so no microbatch index is read back from the device).
            microbatch = progress.next_microbatch
            progress.next_microbatch += 1
        if self.values_checked or self.inferring:
            output = self._run(microbatch, x, received)
        else:
            output = self._run_checking_values(microbatch, x, received)
        if not self.is_last:
            if not torch.is_tensor(output):
                raise TypeError(self._several_outputs(output))
            if torch.is_grad_enabled() and not output.requires_grad:
                # No gradient flows through this stage or before it (frozen layers): its backward has nothing to
                # compute, but the schedule runs one on the output, which needs a tensor that takes a gradient.
                output = output.detach().requires_grad_()
            # A channels-last or transposed block output (ConvNeXt) is made contiguous for the wire.
            sent = self.runtime.carried.to_send(self.index, received)
            return (output.contiguous(), *sent) if sent else output.contiguous()
        if self.inferring:
            self.runtime.trial_output = output
        else:
            self.runtime.outputs[microbatch] = output
        return _main_tensor(output)

    def _run(self, microbatch: int, x: torch.Tensor, received: tuple[torch.Tensor, ...] = ()) -> object:
        """The captured network call of ``microbatch`` through this stage: its last block's output, or on the last
        stage the network's output."""
        progress = self._progress
        progress.received = None if self.is_first else contiguous_grad(x)
        call = self.runtime.calls[microbatch]
        self.runtime.active = self
        self.runtime.carried.begin_call(tuple(contiguous_grad(value) for value in received))
        try:
            return call.module(*call.args, **call.kwargs)
        except _StageDone as done:
            return done.output
        finally:
            self.runtime.active = None
            progress.received = None

    def _run_checking_values(self, microbatch: int, x: torch.Tensor, received: tuple[torch.Tensor, ...]) -> object:
        """``_run`` with the stand-ins' values marked NaN: the output is the same unless the stage depends on them,
        which is refused. Once per stage (reading the check back is its one host sync), unless the received
        activation itself holds NaN: then nothing can be told, and the next forward checks again."""
        check = self.runtime.value_check
        check.on, check.last = True, None
        untouched: list[bool] = []
        # Ahead of every other pre-hook (tensor parallelism's input layouts, FSDP's casts): the input as the user's
        # code passes it.
        hook = self.blocks[0].register_forward_pre_hook(
            lambda block, args, kwargs: untouched.append(_same_storage(first_input(args, kwargs), check.last)),
            prepend=True,
            with_kwargs=True,
        )
        try:
            output = self._run(microbatch, x, received)
        finally:
            hook.remove()
            check.on, check.last = False, None
        if _holds_nan(x):
            return output
        self.values_checked = True
        # The last stage's check reads the tensor the schedule tracks (the logits), not every output: with
        # `output_hidden_states`, a network's output also holds the stand-ins' hidden states, unused by the loss.
        if not all(untouched) or _holds_nan(_main_tensor(output) if self.is_last else output):
            raise RuntimeError(self._depends_on_standins())
        return output

    def _depends_on_standins(self) -> str:
        split = self.runtime.split
        first = f"{split.container_fqn}.{self.block_range.start}"
        placeholders = self.runtime.placeholders()
        elsewhere = f"{', '.join(placeholders)} (run by the first stage) or " if placeholders else ""
        return (
            f"Pipeline stage {self.index} (from {first}) computes with values that only other stages compute: its"
            f" output depends on the outputs of {elsewhere}blocks outside the stage beyond the activation the"
            " previous stage sends it, or the model changes that activation between two blocks at the stage's start."
            " Pipeline stages pass one activation from block to block, and the outputs of modules before the blocks"
            " that blocks take as they are (an encoder's output), so a model whose blocks also take values computed"
            " from the embeddings (an `x0` skip connection, as in modded-nanogpt) or the outputs of earlier blocks"
            " (U-Net-style skip connections) would train wrong when split. Use"
            " pipeline_parallel_size=1 for this model (tensor and data parallelism run it as is)."
        )

    def _several_outputs(self, output: object) -> str:
        split = self.runtime.split
        last = f"{split.container_fqn}.{self.block_range.stop - 1}"
        kinds = [type(v).__name__ if not torch.is_tensor(v) else f"Tensor{tuple(v.shape)}" for v in tree_leaves(output)]
        return (
            f"Pipeline stage {self.index} ends with block {last}, which returns {type(output).__name__} of {kinds}"
            " rather than one tensor: the model's next block reads more from it than the hidden states (T5's blocks"
            " hand on their attention position bias). Pipeline stages pass one activation from block to block, so"
            " this model cannot be split into stages. Use pipeline_parallel_size=1 for it (tensor and data"
            " parallelism run it as is)."
        )

    def reset(self) -> None:
        self._progress.next_microbatch = 0


class DirectParameters(nn.Module):
    """The parameters a module on the path to the blocks holds itself (a ViT's ``cls_token``), owned by a stage.

    It shares that module's parameter table, so the model's code reads whatever the stage's data-parallel wrap puts
    there (sharded or gathered DTensors), and the model's state-dict keys stay its own.
    """

    def __init__(self, holder: nn.Module) -> None:
        super().__init__()
        share_parameter_slots(self, holder)


@dataclass
class _StageProgress:
    next_microbatch: int = 0
    received: torch.Tensor | None = None


def _holds_nan(tree: object) -> bool:
    """Whether any floating-point tensor in ``tree`` holds a NaN (reads one flag back from the device; a DTensor's
    local part)."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    flags = [local(t).isnan().any() for t in tree_leaves(tree) if torch.is_tensor(t) and t.is_floating_point()]
    return bool(torch.stack(flags).any()) if flags else False


def _same_storage(value: object, marked_output: torch.Tensor | None) -> bool:
    """Whether ``value`` is ``marked_output`` or a view of it (a block's tuple output indexed, reshaped)."""
    if marked_output is None:
        return True  # no floating-point stand-in output before this block: nothing to compare
    return torch.is_tensor(value) and value.untyped_storage().data_ptr() == marked_output.untyped_storage().data_ptr()


def _main_tensor(output: object) -> torch.Tensor:
    """The tensor the schedule tracks for the last stage's output (logits of a Hugging Face output)."""
    if torch.is_tensor(output):
        return output
    for value in output.values() if isinstance(output, dict) else cast(Iterable[object], output):
        if torch.is_tensor(value) and value.is_floating_point():
            return value
    raise TypeError("The network's output holds no floating-point tensor; pipeline parallelism needs one.")


class PipelineRuntime:
    """This rank's stages and what a step needs to run them: the captured calls and the last stage's outputs."""

    def __init__(self, module: nn.Module, split: PipelineSplit, my_stages: list[int], num_stages: int) -> None:
        self.split = split
        self.num_stages = num_stages
        self.calls: list[NetworkCall] = []
        self.outputs: dict[int, object] = {}
        self.trial_output: object = None  # the last stage's output in torch's shape-inference trial
        self.inferring = False
        self.active: Stage | None = None
        self.tied_gradients: TiedGradients | None = None  # set by `apply`
        self.value_check = ValueCheck()  # shared by this rank's stand-ins and gates
        self.carried = CarriedValues()  # what later stages take from the first stage besides the activation
        self._carry_hooks: list[RemovableHandle] = []
        self.module = module
        owns_first, owns_last = 0 in my_stages, num_stages - 1 in my_stages
        container = module.get_submodule(split.container_fqn)  # a ModuleList/Sequential: indexed by block
        mine = {i for s in my_stages for i in split.blocks_of(s)}
        # What the split changed on the user's module, for `unsplit`: (fqn, stand-in, the module it replaced)
        # and (block, its instance `forward` before the gate, if it had one).
        self._replaced: list[tuple[str, nn.Module, nn.Module]] = []
        self._gated: list[tuple[nn.Module, Callable[..., object] | None]] = []
        for index in range(split.num_blocks):
            fqn = f"{split.container_fqn}.{index}"
            if index in mine:
                block = block_at(container, index)
                self._gated.append((block, vars(block).get("forward")))
                _gate(block, index, self)
            else:
                self._replace(module, fqn, PassThrough(self.value_check, block_at(container, index)))
        if not owns_first:
            for leaf in (leaf for fqn in split.before for leaf in _placeholder_targets(module, fqn)):
                original = module.get_submodule(leaf)
                self._replace(module, leaf, Placeholder(original, self.value_check, leaf, self.carried))
        if not owns_last:
            for fqn in split.after:
                self._replace(module, fqn, Unreachable())
        standins = [(standin, original) for _, standin, original in self._replaced]
        keep_tied_names(module, standins)
        self._demoted: list[tuple[nn.Module, str, nn.Parameter]] = []
        holders = self._place_direct_parameters(module, my_stages)
        self.stages = []
        for stage in my_stages:
            ends = [module.get_submodule(f) for f in (split.before if stage == 0 else [])]
            ends += [module.get_submodule(f) for f in (split.after if stage == num_stages - 1 else [])]
            ends += holders.get(stage, [])
            self.stages.append(Stage(self, stage, [block_at(container, i) for i in split.blocks_of(stage)], ends))
        for standin, _ in standins:  # a stand-in holding a tied weight goes with the stage that uses the weight
            held = list(standin.parameters(recurse=False))
            holder = (
                next((s for s in self.stages if any(p is held[0] for p in s.owned.parameters())), None)
                if held
                else None
            )
            if holder is not None:
                holder.owned.append(standin)

    def _replace(self, module: nn.Module, fqn: str, standin: nn.Module) -> None:
        self._replaced.append((fqn, standin, module.get_submodule(fqn)))
        replace_module(module, fqn, standin)

    def _place_direct_parameters(self, module: nn.Module, my_stages: list[int]) -> dict[int, list[nn.Module]]:
        """Parameters held directly by the modules on the path to the blocks: the stage that uses them owns them
        (``DirectParameters``, by stage); elsewhere they become buffers (the network code still reads them; their
        values do not matter there)."""
        split, last = self.split, self.num_stages - 1
        holders: dict[int, list[nn.Module]] = {0: [], last: []}
        for stage, names in ((0, split.before_parameters), (last, split.after_parameters)):
            for parent_fqn in dict.fromkeys(name.rpartition(".")[0] for name in names):
                parent = module.get_submodule(parent_fqn)
                if stage in my_stages:
                    holders[stage].append(DirectParameters(parent))
                else:
                    self._demote(parent)
        return holders

    def _demote(self, parent: nn.Module) -> None:
        for name, param in list(parent.named_parameters(recurse=False)):
            delattr(parent, name)
            parent.register_buffer(name, param.detach(), persistent=False)
            self._demoted.append((parent, name, param))

    def agree_carried(self, group: ProcessGroup) -> None:
        """Decide with the pipeline group (a collective, at the first step, once the calls are captured) which values
        the first stage sends besides the activation; the ranks holding the first stage then keep them as their
        modules compute them.

        Found by the ranks without the first stage, whose modules before the blocks are all placeholders (a rank
        with the first stage computes those values itself on its later stages of a looped or V schedule, and its
        modules' data-parallel wrap cannot run outside a stage's forward)."""
        owns_first = any(stage.is_first for stage in self.stages)
        found = set() if owns_first else set().union(*(self.discover_carried(stage) for stage in self.stages))
        gathered: list[Any] = [None] * dist.get_world_size(group)  # Any: what `all_gather_object` unpickles
        dist.all_gather_object(gathered, sorted(found), group=group)
        self.carried.keys = sorted({tuple(key) for keys in gathered for key in keys})
        if owns_first:
            for name in dict.fromkeys(key[0] for key in self.carried.keys):
                hook = lambda module, args, output, name=name: self.carried.module_output(name, output)
                self._carry_hooks.append(self.module.get_submodule(name).register_forward_hook(hook))

    def discover_carried(self, stage: Stage) -> set[CarryKey]:
        """Which placeholder outputs ``stage``'s blocks take as arguments: the network call of microbatch 0 with
        every block of this rank replaced by an ``ArgumentRecorder`` (``carry.py``), those of ``stage`` recording.
        A call that fails here fails again in the stage's real first forward, with its own context."""
        container = self.module.get_submodule(self.split.container_fqn)
        last = stage.block_range.stop - 1
        blocks = [(i, b, s is stage) for s in self.stages for i, b in zip(s.block_range, s.blocks, strict=True)]
        call = self.calls[0]
        self.carried.discovering = True
        self.carried.begin_call()
        for index, block, recording in blocks:
            done = _StageDone if recording and index == last else None
            replace_module(container, str(index), ArgumentRecorder(block, self.carried if recording else None, done))
        try:
            with torch.no_grad():
                call.module(*call.args, **call.kwargs)
        except Exception:  # _StageDone at the stage's last block, or the model's own error (see above)
            pass
        finally:
            for index, block, _ in blocks:
                replace_module(container, str(index), block)
        return self.carried.end_discovery()

    def placeholders(self) -> list[str]:
        """The prologue modules this rank replaced with placeholders (their FQNs)."""
        return [fqn for fqn, standin, _ in self._replaced if isinstance(standin, Placeholder)]

    def unsplit(self, module: nn.Module) -> None:
        """Undo the split on ``module``: the replaced modules back in place, the blocks' gates off.

        The modules of other ranks' stages come back with the weights they had when the model was split (this rank
        never trained them); ``HybridStrategy.full_state_dict()`` or a checkpoint holds the trained model.
        """
        for fqn, _, original in reversed(self._replaced):
            replace_module(module, fqn, original)
        for parent, name, param in self._demoted:  # in their order: the parameters' order is the optimizer's
            delattr(parent, name)
            parent.register_parameter(name, param)
        for block, forward in self._gated:
            if forward is None:
                vars(block).pop("forward", None)
            else:
                block.forward = forward
        for handle in self._carry_hooks:
            handle.remove()
        self._replaced, self._gated, self._demoted, self._carry_hooks = [], [], [], []

    def start_step(self, calls: list[NetworkCall]) -> None:
        self.calls, self.outputs = calls, {}
        for stage in self.stages:
            stage.reset()


def _placeholder_targets(module: nn.Module, fqn: str) -> list[str]:
    """The modules that stand in for the prologue module ``fqn``: itself, or for a ModuleList/ModuleDict/Sequential
    (indexed or iterated by the user's code, e.g. a list of value embeddings) each of its children with parameters."""
    found = module.get_submodule(fqn)
    if not isinstance(found, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return [fqn]
    return [
        leaf
        for name, child in found.named_children()
        if any(True for _ in child.parameters())
        for leaf in _placeholder_targets(module, f"{fqn}.{name}")
    ]


def apply(module: nn.Module, mesh: DeviceMesh, options: ParallelOptions) -> PipelineRuntime:
    """Keep this rank's stages of ``module`` (in place) and return them. Collective over the whole ``mesh``."""
    schedule, pp_mesh = options.pipeline_schedule, mesh[PP_AXIS]
    per_rank = stages_per_rank(schedule, options.stages_per_rank)
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp_size * per_rank
    split = plan_split(module, num_stages, options.pipeline_split)
    ties = find_cross_stage_ties(
        module, split.module_stages(), [stage_owner(schedule, s, pp_size, per_rank) for s in range(num_stages)]
    )
    runtime = PipelineRuntime(module, split, stage_indices(schedule, pp_rank, pp_size, per_rank), num_stages)
    runtime.tied_gradients = TiedGradients(ties, mesh, pp_rank)
    return runtime


def _gate(block: nn.Module, index: int, runtime: PipelineRuntime) -> None:
    """Make an owned block run only inside its own stage, swap in the received activation, end the stage."""
    forward = block.forward

    def gated(*args: object, **kwargs: object) -> object:
        stage = runtime.active
        if stage is None:
            return forward(*args, **kwargs)
        blocks = stage.block_range
        if index not in blocks:  # another stage of this rank: a pass-through
            return marked(first_input(args, kwargs), runtime.value_check)
        if index == blocks.start and stage.received is not None:
            args, kwargs = _with_hidden(args, kwargs, stage.received)
        output = forward(*args, **kwargs)
        if index == blocks.stop - 1 and not stage.is_last:
            raise _StageDone(output)
        return output

    block.forward = gated


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    first = next(iter(kwargs))
    return args, {**kwargs, first: hidden}
