"""How the command line ends on a user's error, and how it prints its options' help.

A refused value is a ``ValueError`` (the library's convention: the message names the value and the fix) or a
:class:`UsageError`; they end the command with exit status 2, as argparse's own usage errors do. A package the
command needs and the environment lacks (``extras.MissingExtra``, naming the pip extra) and a damaged or missing
file exit 1. Anything else is reported in one line too, with its type; ``--debug`` shows its traceback.
"""

from __future__ import annotations

import argparse

from lightning_mgpu.extras import MissingExtra

USAGE_STATUS = 2
FAILURE_STATUS = 1


class UsageError(ValueError):
    """A command-line value that cannot work; the message names it and the fix."""


def exit_status(error: Exception) -> tuple[int, str]:
    """The exit status and the message a command prints for ``error`` (an unexpected error: its type and first
    line)."""
    message = str(error).strip()
    if isinstance(error, (ValueError, NotImplementedError)) or _is_lightning_refusal(error):
        return USAGE_STATUS, message
    if isinstance(error, (MissingExtra, OSError)) or _is_checkpoint(error):  # a file missing, unreadable
        return FAILURE_STATUS, message
    first = (message.splitlines() or [""])[0]
    return FAILURE_STATUS, f"{type(error).__name__}: {first} (run again with --debug for the traceback)"


def _is_lightning_refusal(error: Exception) -> bool:
    """Lightning's refusal of a Trainer argument (``--accelerator``, ``--precision``)."""
    import sys

    module = sys.modules.get("lightning.fabric.utilities.exceptions")
    return module is not None and isinstance(error, module.MisconfigurationException)


def _is_checkpoint(error: Exception) -> bool:
    """A damaged checkpoint's error (its module is loaded wherever one was raised: nothing is imported here)."""
    import sys

    module = sys.modules.get("lightning_mgpu.checkpoint.format")
    return module is not None and isinstance(error, module.CheckpointError)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default once: not where its help already says it, nor for flags and unset (None)
    defaults, whose help says what happens instead."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (sizes, counts, steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer of 0 or more, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer of 0 or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (memory, FLOP/s, bandwidths)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def size_or_auto(text: str) -> int | str:
    """An argparse type: a parallel size, a positive integer or ``auto``."""
    return "auto" if text == "auto" else positive_int(text)
