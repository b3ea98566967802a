"""Performer's options (no torch; the method itself is in ``performer.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import AttentionOptions, check_int, check_non_negative_number, check_positive_int, option
from .registry import declare_options


@dataclass
class PerformerOptions(AttentionOptions):
    # The stabilisers fix the features' scale relative to the largest key, not to den, which can be ~1e-3
    # for a query far from every key: 1e-6 would then shrink that row by 0.1%. performer-pytorch adds none.
    eps: float = option(1e-12, "added to the linear-attention denominator (only guards an underflowed den; "
                        "1e-12 here, not 1e-6: den has no fixed scale under the stabilisers)")
    num_features: int = option(0, "m, random features; 0 = int(d ln d) (266 for d = 64, performer-pytorch's default)")
    seed: int = option(0, "seed of the random matrix W (drawn once at conversion, then saved with the model)")
    kernel_epsilon: float = option(0.0, "uniform floor added inside phi (performer-pytorch's kernel_epsilon, 1e-4 "
                                   "there); 0 keeps the estimator unbiased")

    def __post_init__(self):
        super().__post_init__()
        if self.num_features != 0:
            check_positive_int(self, "num_features")
        check_int(self, "seed")
        check_non_negative_number(self, "kernel_epsilon")


declare_options(PerformerOptions, "performer")
