"""T2R's and T2R-HH's options (no torch; the method itself is in ``t2r.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import AttentionOptions, check_positive_int, option
from .registry import declare_options


@dataclass
class T2ROptions(AttentionOptions):
    feature_dim: int = option(64, "D, features per head (64 in the public T2R scripts)")

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "feature_dim")


declare_options(T2ROptions, "t2r", "t2r-hh")
