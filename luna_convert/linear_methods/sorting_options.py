"""The sorting kernels' options (no torch; the method itself is in ``sorting.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import KERNEL_KIND, AttentionOptions, check_choice, check_positive_int, option
from .registry import declare_options

PROFILES = ("laplace", "matern32")


@dataclass
class SortingOptions(AttentionOptions):
    projections: int = option(16, "R, learned 1-D projections per head (derived: no value published)")
    profile: str = option("laplace", "univariate kernel kappa: 'laplace' exp(-|t|) or 'matern32' (1+|t|)exp(-|t|)")
    bandwidth: float = option(1.0, "initial h_r of every projection (derived; h_r >= 1e-2 x this)")
    background: float = option(1e-4, "initial c0 / sum_r w_r, a constant kernel floor so no query is left "
                                      "without keys (derived)")

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "projections")
        check_choice("profile", self.profile, PROFILES)
        for name in ("bandwidth", "background"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")


declare_options(SortingOptions, "sorting", kind=KERNEL_KIND)
