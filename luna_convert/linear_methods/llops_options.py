"""LLoPS's options (no torch; the method itself is in ``llops.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import AttentionOptions, check_int, check_positive_int, option
from .registry import declare_options


@dataclass
class LLoPSOptions(AttentionOptions):
    rank: int = option(16, "r, sketch rank per head; D = r(r+1)/2 features (136 for r = 16)")
    degree: int = option(4, "p, even polynomial degree of the kernel (p/2 CP factors per sketch coordinate)")
    homogeneous: bool = option(False, "PolySketch's homogeneous <q, k>^p (no constant 1 in x~; symmetric in "
                               "the sign of s); default the inhomogeneous, exp-matching (1 + s/(p tau))^p")
    qk_norm: bool = option(False, "PolySketch's LayerNorm (eps 1e-5, no affine) on q and k before the sketch; "
                           "off: it would discard the pretrained q/k geometry")
    seed: int = option(0, "seed of the initial Gaussian sketch (drawn once at conversion, then saved)")

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "rank", "degree")
        if self.degree % 2:
            raise ValueError(f"degree must be even (phi packs psi psi^T), got {self.degree!r}")
        check_int(self, "seed")


declare_options(LLoPSOptions, "llops")
