"""ELA's options (no torch; the method itself is in ``ela.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import AttentionOptions, check_choice, option
from .registry import declare_options

KERNELS = ("exp", "l2sum", "l2sub")


@dataclass
class ELAOptions(AttentionOptions):
    # The exp features are shifted to at most 1, so a row's sum can be far below 1: a guard of 1e-6 would
    # visibly shrink such rows (derived).
    eps: float = option(1e-12, "added to the denominator (exp); the squared-distance kernels divide by max(den, eps)")
    kernel: str = option("exp", "'exp' Hadamard-exp (the paper's recommended default), 'l2sum' ||q+k||^2 "
                                "or 'l2sub' ||q-k||^2")

    def __post_init__(self):
        super().__post_init__()
        check_choice("kernel", self.kernel, KERNELS)


declare_options(ELAOptions, "ela")
