"""User-facing errors. Each message is one line that says what is wrong and what to do;
the CLI prints it without a traceback and exits non-zero."""

from __future__ import annotations

import difflib
from typing import Iterable


class LunaConvertError(Exception):
    """Base class: an input the tool cannot use (not a bug in the tool)."""


class ConversionError(LunaConvertError):
    """A model that cannot be converted as asked."""


class UnknownNameError(LunaConvertError, KeyError):
    """An unknown method, recipe, task, split or option name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> UnknownNameError:
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return UnknownNameError(f"unknown {kind} {name!r}.{hint} Available: {', '.join(choices)}")


PEFT_INSTALL_HINT = "LoRA needs the peft library: pip install 'luna-convert[lora]' (or pip install peft)"


def check_peft_available() -> None:
    """LoRA's library is installed (checked with the run config, before torch is loaded), or the install hint."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise LunaConvertError(PEFT_INSTALL_HINT) from None


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C; ``run_dir``: its folder, to resume from (None: nothing was written yet)."""

    def __init__(self, run_dir=None):
        super().__init__(run_dir)
        self.run_dir = run_dir
