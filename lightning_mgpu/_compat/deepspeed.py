"""DeepSpeed internals the DeepSpeed backend's checkpoint states use (checked on deepspeed 0.19.8).

- ``fragment_mapping``: ``param._hp_mapping``, the fragment of this rank's flat fp32 partition that a ZeRO-1/2 (or
  bf16) parameter maps to (set by ``deepspeed.utils.mixed_precision_linkage.link_hp_params``; ``None`` on a rank
  whose partition holds none of it). Public stand-in: ``deepspeed.utils.safe_get_full_fp32_param`` and friends,
  which gather the whole tensor (a collective per parameter) where a sharded checkpoint needs the local piece.
- ``relink_optimizer_states``: ``_hp_optimizer_states_linked`` and ``_lazy_init_hp_params_optimizer_state()`` of
  ``DeepSpeedZeroOptimizer`` and ``BF16_Optimizer``, which point each fragment at its optimizer states. DeepSpeed
  links them once, after stepping its first param group, so a multi-group optimizer's other groups (and states
  created by a load) stay unlinked. No public stand-in.

``check()`` (``tests/_compat/test_contract.py``) fails loudly, naming the internal, when DeepSpeed renames one.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_mgpu._compat import InternalChanged, installed_version

CHECKED_DEEPSPEED = "0.19.8"
_MAPPING = "_hp_mapping"
_LINKED = "_hp_optimizer_states_linked"
_LINK = "_lazy_init_hp_params_optimizer_state"


def has_fragment_mapping(param: object) -> bool:
    """Whether DeepSpeed's ZeRO-1/2 (or bf16) optimizer maps this parameter to its flat fp32 partitions."""
    return hasattr(param, _MAPPING)


def fragment_mapping(param: object) -> Any | None:  # Any: DeepSpeed's untyped `tensor_fragment`
    """The parameter's fragment mapping (``hp_fragment``, ``get_optim_state_fragment(key)``, ``update_hp()``,
    ``lp_fragment_address``), or None where this rank's partition holds none of it."""
    return getattr(param, _MAPPING, None)


def relink_optimizer_states(zero_optimizer: object) -> None:
    """Point every parameter's fragment at its param group's current optimizer states (local: views)."""
    if zero_optimizer is not None and hasattr(zero_optimizer, _LINK):
        setattr(zero_optimizer, _LINKED, False)
        getattr(zero_optimizer, _LINK)()


def check() -> None:
    """Raise :class:`InternalChanged` when the installed DeepSpeed lacks an internal used here."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import mixed_precision_linkage

    optimizers = (DeepSpeedZeroOptimizer, BF16_Optimizer)
    problems = [f"{cls.__name__}.{_LINK}" for cls in optimizers if not hasattr(cls, _LINK)]
    problems += [f"{cls.__name__} sets {_LINKED}" for cls in optimizers if _LINKED not in inspect.getsource(cls)]
    if f".{_MAPPING} =" not in inspect.getsource(mixed_precision_linkage):
        problems.append(f"mixed_precision_linkage sets param.{_MAPPING}")
    if problems:
        raise InternalChanged(
            f"lightning_mgpu relies on DeepSpeed internals checked on deepspeed {CHECKED_DEEPSPEED}; the installed"
            f" deepspeed {installed_version('deepspeed')} lacks: {', '.join(problems)}. Update"
            f" lightning_mgpu/_compat/deepspeed.py or install deepspeed=={CHECKED_DEEPSPEED}."
        )
