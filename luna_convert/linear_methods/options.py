"""Method options without torch: the options every method's dataclass extends (:class:`AttentionOptions`),
the helpers that validate them, and the two kinds of attention core by name.

A method's options dataclass holds its defaults, its validation (``__post_init__``: a bad value is a
one-line ValueError) and, field by field, what ``save`` writes. It lives in a module that imports no torch
(``luna_options.py`` beside ``luna.py``), so a run config is read and checked before torch is loaded.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

FEATURE_MAP_KIND = "feature map"
KERNEL_KIND = "kernel"


def option(default: Any, help: str) -> Any:
    """A dataclass field with a default and the one-line help `luna-convert methods --details` shows."""
    return field(default=default, metadata={"help": help})


def check_positive_int(options: Any, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(options: Any, *names: str, non_negative: bool = False) -> None:
    for name in names:
        value = getattr(options, name)
        if not is_int(value) or (non_negative and value < 0):
            raise ValueError(f"{name} must be a{' non-negative' if non_negative else 'n'} integer, got {value!r}")


def check_non_negative_number(options: Any, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if not is_number(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")


def check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(repr, choices))}")


@dataclass
class AttentionOptions:
    """Options of the attention layer itself, shared by every method (each method's options extend these).

    Everything here is saved: ``asdict(options)`` is the ``options`` of linear_attention.json.
    """

    dwc: bool = option(False, "add a depthwise-convolution branch on V (FLatten-style; zero-initialised)")
    dwc_kernel: int = option(3, "kernel size of the DWC branch (odd; k x k on the ViT patch grid)")
    eps: float = option(1e-6, "added to the linear-attention denominator")
    window: int = option(0, "w > 0: exact softmax over keys with |i - j| <= w, learned per-head gamma x linear "
                            "attention beyond (feature-map methods; cost O(N w D)); 0: off")

    def __post_init__(self):
        if isinstance(self.dwc_kernel, bool) or not isinstance(self.dwc_kernel, int) or self.dwc_kernel < 1 \
                or self.dwc_kernel % 2 == 0:
            # an even kernel with padding k // 2 would change the sequence length
            raise ValueError(f"dwc_kernel must be a positive odd integer, got {self.dwc_kernel!r}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"eps must be a positive number, got {self.eps!r}")
        check_int(self, "window", non_negative=True)

    # Values for options a folder saved by an older version lacks, where they differ from today's
    # defaults (a method whose defaults changed lists the old ones here, so old models rebuild as saved).
    saved_before: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def to_dict(self) -> dict:
        return asdict(self)

    def changed(self) -> dict:
        """The options that differ from their defaults, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @classmethod
    def with_saved_defaults(cls, saved: Mapping[str, Any]) -> dict:
        """``saved`` (the options of a linear_attention.json) with every key it lacks that an older
        version did not write filled in with that version's value."""
        return {**{k: v for k, v in cls.saved_before.items() if k not in saved}, **saved}


def option_table(options_class: type[AttentionOptions]) -> list[tuple[str, Any, str]]:
    """(name, default, help) of every option of ``options_class``."""
    return [(f.name, f.default if f.default is not MISSING else None, f.metadata.get("help", ""))
            for f in fields(options_class)]

