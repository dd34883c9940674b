"""Values a later pipeline stage takes from the first stage besides the activation: outputs of the modules before
the blocks that the blocks read as arguments, such as an encoder's output that decoder blocks cross-attend to
(``nn.Transformer``'s ``memory``, BART's ``encoder_hidden_states``).

A later stage has only placeholders for those modules (zeros shaped like their output), so such a value must come
from the first stage, like the activation. Which ones do is found once, at the first step: each rank runs the
network call of its later stages with every block of the stage handing its input on (nothing is computed), and
records which of the blocks' other arguments are a placeholder's output or a view of it; the pipeline group agrees
on the union (``CarriedValues.keys``). From then on the first stage sends those values after the activation, every
stage hands them on, and a later stage's placeholder returns the value received instead of zeros; their gradients
come back through the schedule as the activation's do. A model that needs none (GPT, Llama: the blocks read only
the activation) sends exactly what it sent before.

Only direct uses are carried (the value itself or a view of it): a value the model's code derives from a
placeholder's output before passing it to a block is still refused by the stage's value check (``split.py``).
"""

from __future__ import annotations

from collections import Counter

import torch

from lightning_mgpu._compat.tensors import tree_leaves, tree_map

# (placeholder FQN, which of its calls within one network call, which tensor of its output)
CarryKey = tuple[str, int, int]


class CarriedValues:
    """Shared by a rank's stages, block gates, placeholders and the first stage's module hooks."""

    def __init__(self) -> None:
        self.keys: list[CarryKey] | None = None  # agreed by the pipeline group at the first step; None before
        self.discovering = False
        self.found: set[CarryKey] = set()
        self._made: dict[int, CarryKey] = {}  # while discovering: a placeholder output's storage -> its key
        self._alive: list[torch.Tensor] = []  # ... kept alive so that storages stay theirs
        self._calls: Counter[str] = Counter()
        self.received: dict[CarryKey, torch.Tensor] = {}  # a later stage's values for the current microbatch
        self.computed: dict[CarryKey, torch.Tensor] = {}  # the first stage's values for the current microbatch

    @property
    def any(self) -> bool:
        return bool(self.keys)

    def begin_call(self, received: tuple[torch.Tensor, ...] = ()) -> None:
        """Before each run of the network call: count placeholder calls afresh; ``received`` in ``keys`` order."""
        self._calls.clear()
        self.computed = {}
        self.received = dict(zip(self.keys or [], received, strict=False))

    def next_call(self, name: str) -> int:
        """The index of this call of the module ``name`` within the current network call."""
        call = self._calls[name]
        self._calls[name] += 1
        return call

    def placeholder_output(self, name: str, output: object) -> object:
        """A placeholder's zeros, with the values received in place of those that are carried (recorded while
        discovering)."""
        call = self.next_call(name)
        leaves = [t for t in tree_leaves(output) if torch.is_tensor(t)]
        if self.discovering:
            for index, tensor in enumerate(leaves):
                self._made[tensor.untyped_storage().data_ptr()] = (name, call, index)
                self._alive.append(tensor)
            return output
        return self._received_in(name, call, leaves, output)

    def module_output(self, name: str, output: object) -> object:
        """A forward hook on the real module ``name`` (on the ranks holding the first stage): on the first stage its
        carried tensors are kept to be sent; on a later stage of the same rank (V schedules) the values received
        replace them, as a placeholder's would."""
        call = self.next_call(name)
        leaves = [t for t in tree_leaves(output) if torch.is_tensor(t)]
        for index, tensor in enumerate(leaves):
            if (name, call, index) in (self.keys or ()):
                self.computed[(name, call, index)] = tensor
        return self._received_in(name, call, leaves, output)

    def _received_in(self, name: str, call: int, leaves: list[torch.Tensor], output: object) -> object:
        swap = {id(t): self.received[(name, call, i)] for i, t in enumerate(leaves) if (name, call, i) in self.received}
        if not swap:
            return output
        if torch.is_tensor(output):
            return swap[id(output)]
        return tree_map(lambda t: swap.get(id(t), t) if torch.is_tensor(t) else t, output)

    def block_arguments(self, args: tuple, kwargs: dict) -> None:
        """While discovering: the placeholder outputs among a block's arguments besides its hidden-state input."""
        rest = [*args[1:], *list(kwargs.values())[0 if args else 1 :]]
        for tensor in (t for t in tree_leaves(rest) if torch.is_tensor(t)):
            key = self._made.get(tensor.untyped_storage().data_ptr())
            if key is not None:
                self.found.add(key)

    def end_discovery(self) -> set[CarryKey]:
        found, self.found, self._made, self._alive, self.discovering = self.found, set(), {}, [], False
        return found

    def to_send(self, stage_index: int, received: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """What a stage sends after its activation: the first stage its modules' values, a later one what it
        received (copies: the schedule detaches a stage's outputs in place, which a view or the input itself cannot
        be; the gradients of its own uses and the next stage's add up on the input)."""
        if not self.keys:
            return ()
        if stage_index > 0:
            return tuple(value.clone() for value in received)
        missing = [key for key in self.keys if key not in self.computed]
        if missing:
            raise RuntimeError(
                f"Pipeline stage 0 did not compute {missing} this microbatch, which later stages read from it (the"
                " network call ran differently than at the first step). Use pipeline_parallel_size=1 for this model."
            )
        return tuple(self.computed[key].contiguous() for key in self.keys)
