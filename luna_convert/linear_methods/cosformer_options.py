"""cosFormer's options (no torch; the method itself is in ``cosformer.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import AttentionOptions, option
from .registry import declare_options


@dataclass
class CosformerOptions(AttentionOptions):
    prefix_neutral: bool = option(True, "derived: ViT prefix tokens (CLS, registers) weigh cos = 1 with every token "
                                  "and patches are ranked among patches (D = 4d on such inputs); false: one "
                                  "raster index over [prefix, patches] (the official code's order)")


declare_options(CosformerOptions, "cosformer")
