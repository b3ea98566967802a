"""Hedgehog: Zhang et al. 2024, "The Hedgehog & the Porcupine: Expressive Linear Attentions with
Softmax Mimicry" (ICLR).

phi(x) = [softmax(W x + b), softmax(-(W x + b))] per head, W = I at init, separate maps for q
and k; trained first to mimic softmax attention (distillation), then finetuned.

Its forward is plain PyTorch (any dtype and device): one head-major product for the logits and two softmaxes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.context import AttentionContext
from .base import AttentionOptions, FeatureMap, Method
from .registry import register


class HedgehogFeatureMap(FeatureMap):
    """Two separate softmaxes over d (not one over 2d); one Linear(d, d) per head (``softmax_pair_features``)."""

    options_class = AttentionOptions  # no options of its own
    shared_qk = False
    context_free = True

    def __init__(self, head_dim: int, num_heads: int, options: AttentionOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1))  # [H, d, d]
        self.bias = nn.Parameter(torch.zeros(num_heads, 1, head_dim))

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        return softmax_pair_features(x, self.weight, self.bias)


def softmax_pair_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[softmax(z), softmax(-z)] with z = x W_h^T + b_h, for x [B, H, N, d], weight [H, d, d], bias [H, 1, d]: the
    PyTorch path (any dtype and device)."""
    b, h, n, d = x.shape
    # W_h x + b_h for all heads in one baddbmm (bias fused), head-major: [H, B*N, d] is a view of the heads
    # split from [B, N, H*d] and for B = 1 the result is in [B, H, N, d] order as it stands (the 4-D einsum
    # made about ten calls around its product: permutes, views, a copy of x, the bias add).
    z = torch.baddbmm(bias, x.transpose(0, 1).reshape(h, b * n, d), weight.transpose(1, 2))
    z = z.view(h, b, n, d).transpose(0, 1)
    return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


HEDGEHOG = register(Method(
    name="hedgehog", core=HedgehogFeatureMap, distill=True,
    description="Hedgehog: [softmax(Wx+b), softmax(-(Wx+b))] per head, W=I; distil, then finetune (Zhang et al. 2024)",
    paper="Zhang et al. 2024, The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax Mimicry (ICLR)",
    details="""Confirmed (paper): phi(x) = [softmax(Wx + b), softmax(-(Wx + b))], one trainable Linear(d, d) per
head, separate for q and k, W initialised to the identity; stage 1 distils each attention row with the
cross-entropy -sum_j a_ij log a^_ij against softmax (whole model frozen but the maps), stage 2 finetunes.
Chosen among public variants: two separate softmaxes over d (not one over 2d with a factor 2, not raw
exp). Derived: padded batches (pad keys masked in the teacher, phi(k) zeroed at pads, pad query rows
dropped); the GLUE and ViT stage-1 settings are unconfirmed.""",
))
