"""Flexformer's options (no torch; the method itself is in ``flexformer.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import AttentionOptions, check_choice, check_int, check_non_negative_number, option
from .registry import declare_options

VARIANTS = ("positive", "stationary", "nonstationary")


@dataclass
class FlexformerOptions(AttentionOptions):
    # The stabilisers fix the features' scale relative to the largest key, not to den (as Performer's).
    eps: float = option(1e-12, "denominator guard: added to den (positive), den clamped at max(den, eps) "
                        "(stationary / nonstationary)")
    variant: str = option("positive", "'positive' exp features (never a negative den; the notes' recommendation "
                          "where the signed variants give negative denominators, as BERT-scale q/k do), "
                          "'stationary' cos/sin RFF, 'nonstationary' two frequency sets")
    num_frequencies: int = option(0, "m, frequencies per head; 0 = 64 features (m = 64 positive, 32 cos/sin)")
    seed: int = option(0, "seed of the initial frequencies (drawn once at conversion, then saved with the model)")
    nonstationary_offset: float = option(0.1, "nonstationary: O2 = O1 + this x d^(-1/4) x N(0, I) at init (0 ties "
                                         "the two sets, and tied sets get equal gradients, so they stay tied)")
    den_floor: float = option(1.0, "stationary / nonstationary: each row is divided by at least this x m^(-1/2) x "
                              "|phi(q)| sum_j |phi(k_j)| (the estimate's noise level times the bound of its terms), "
                              "never by ~0 (derived; right after conversion 14-51 % of rows had den <= 0)")

    def __post_init__(self):
        super().__post_init__()
        check_choice("variant", self.variant, VARIANTS)
        check_int(self, "num_frequencies", non_negative=True)
        check_int(self, "seed")
        check_non_negative_number(self, "nonstationary_offset")
        if isinstance(self.den_floor, bool) or not isinstance(self.den_floor, (int, float)) or not self.den_floor > 0:
            raise ValueError(f"den_floor must be a positive number, got {self.den_floor!r}")


declare_options(FlexformerOptions, "flexformer")
