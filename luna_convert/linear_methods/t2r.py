"""T2R: Kasai et al. 2021, "Finetuning Pretrained Transformers into RNNs" (EMNLP).

phi(x) = ReLU(W x + b), one Linear(d, D) per layer shared by heads, q and k; q is scaled by
d^-1/2 before the map. Two registered methods share this map and differ in recipe only:
``t2r`` (finetune) and ``t2r-hh`` (Hedgehog's recipe: distil attention, then finetune).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..ops.context import AttentionContext
from .base import FeatureMap, Method
from .t2r_options import T2ROptions
from .registry import register


class T2RFeatureMap(FeatureMap):
    """phi(x) = ReLU(W x + b) with nn.Linear's default init."""

    options_class = T2ROptions
    context_free = True
    prescale_query = True

    def __init__(self, head_dim: int, num_heads: int, options: T2ROptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        self.proj = nn.Linear(head_dim, self.options.feature_dim)

    @property
    def feature_dim(self) -> int:
        return self.proj.out_features

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        return F.relu(self.proj(x))


T2R_DETAILS = """Confirmed (paper and public scripts): phi(x) = ReLU(W x + b), one Linear(d, D) per layer for
all heads, D = 64, default Linear init; one map for q and k; q scaled by d^-1/2 first; pads removed by
zeroing phi(k) (phi(0) = ReLU(b) is not 0). Derived: the encoder (bidirectional) version, since the
public code converts decoders only; the denominator guard is +eps (one public path clamps at 1e-2)."""

T2R = register(Method(
    name="t2r", core=T2RFeatureMap, distill=False,
    description="T2R: ReLU(Wx + b) features, finetune only (Kasai et al. 2021)",
    paper="Kasai et al. 2021, Finetuning Pretrained Transformers into RNNs (EMNLP)",
    details=T2R_DETAILS + "\nRecipe (confirmed): swap, then finetune on the task; no distillation.",
))

T2R_HH = register(Method(
    name="t2r-hh", core=T2RFeatureMap, distill=True,
    description="T2R features trained with Hedgehog's recipe: distil attention, then finetune",
    paper="Kasai et al. 2021 (the map) with Zhang et al. 2024's recipe, as named in the Hedgehog paper",
    details=T2R_DETAILS + "\nRecipe (derived: unconfirmed beyond the name in the Hedgehog paper): attention "
                          "distillation of the map, then finetune.",
))
