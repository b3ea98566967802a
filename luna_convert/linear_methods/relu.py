"""ReLU features: the plain-ReLU kernel of the linear-attention baselines (Katharopoulos et al. 2020's
family; the "ReLU" row of the Hedgehog paper's feature-map comparison).

phi(x) = max(x, 0), elementwise on the raw per-head q and k: D = d, no parameters. A token whose
coordinates are all negative has all-zero features; the layer's denominator guard (+eps,
``AttentionOptions.eps``) then gives that query a zero output instead of 0 / 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.context import AttentionContext
from .base import AttentionOptions, FeatureMap, Method
from .registry import register


class ReluFeatureMap(FeatureMap):
    """phi(x) = relu(x), one map for q and k, no prescale (ReLU is homogeneous: a scale cancels)."""

    options_class = AttentionOptions  # no options of its own
    context_free = True

    @property
    def feature_dim(self) -> int:
        return self.head_dim

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        return F.relu(x)


RELU = register(Method(
    name="relu", core=ReluFeatureMap, distill=False,
    description="ReLU: relu(x) features, no parameters, finetune only (the linear-attention ReLU baseline)",
    paper="Katharopoulos et al. 2020 (the kernel form); ReLU features as the baseline in Zhang et al. 2024 "
          "(Hedgehog, ICLR)",
    details="""Confirmed (method notes, Hedgehog's baseline table): phi(x) = relu(x) on q and k, D = d, no
parameters, one map for q and k. Any 1/sqrt(d) prescale or temperature cancels after normalisation
(ReLU is degree-1 homogeneous), so none is applied. Features can all be zero for a token: the
denominator guard is the layer's +eps (option eps, default 1e-6), which makes such a query's output 0.
Recipe: swap, then finetune; no distillation. Derived: the encoder (bidirectional) form with pads
removed by zeroing phi(k).""",
))
