"""ELU + 1: Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention" (ICML).

phi(x) = elu(x) + 1, elementwise on the raw per-head q and k: D = d, no parameters, strictly positive
features (so the denominator never vanishes). A fixed-kernel floor to compare the learned maps against.
"""

from __future__ import annotations

import torch

from ..ops.context import AttentionContext
from .base import AttentionOptions, FeatureMap, Method
from .registry import register


class EluFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1, one map for q and k, no prescale."""

    options_class = AttentionOptions  # no options of its own
    context_free = True

    @property
    def feature_dim(self) -> int:
        return self.head_dim

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        # elu(x) + 1 = r + exp(x - r), r = relu(x): x - r is min(x, 0), exactly. Not F.elu: on the CPU its
        # expm1 runs scalar, about 6x slower than this whole map (docs/design-decisions.md, *Feature maps*); not
        # clamp or where, whose backward runs another slow kernel. exp never sees a positive x, so no inf.
        r = torch.relu(x)
        return torch.exp(x - r) + r


ELU = register(Method(
    name="elu", core=EluFeatureMap, distill=False,
    description="ELU+1: elu(x) + 1 features, no parameters, finetune only (Katharopoulos et al. 2020)",
    paper="Katharopoulos et al. 2020, Transformers are RNNs: Fast Autoregressive Transformers with Linear "
          "Attention (ICML)",
    details="""Confirmed (paper): phi(x) = elu(x) + 1 on q and k, D = d, no parameters, one map for q and k;
features are > 0, so the denominator is safe (the layer still adds eps). Recipe: swap, then finetune
(the paper trains from scratch; there is nothing to distil). Derived: the encoder (bidirectional) form
with pads removed by zeroing phi(k) (phi(0) = 1 is not 0); no 1/sqrt(d) prescale (the paper has none).
Not carried: the learnable temperature elu(x / tau) + 1 the method notes mention as an option.""",
))
