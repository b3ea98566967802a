"""ELA: Exact Linear Attention (arXiv 2605.18848; code yauntyour/Exact-Linear-Attention).

Kernels that decompose exactly into finite features, one method with the kernel as an option:

    exp     k(q, k) = sum_d exp(q_d / tau) exp(k_d / tau)     phi = psi = exp(x / tau), D = d
    l2sum   k(q, k) = ||q + k||^2      phi(q) = [q, ||q||^2, 1],  psi(k) = [2k, 1, ||k||^2],  D = d + 2
    l2sub   k(q, k) = ||q - k||^2      phi(q) = [q, ||q||^2, 1],  psi(k) = [-2k, 1, ||k||^2], D = d + 2

For ``exp``, a shift c is subtracted before exponentiating: per query its max over d (it cancels in the
row normalisation), and for keys one max over all real keys and dims of the sequence (a per-key shift
would change the weights), so no feature exceeds 1. The squared-distance features are signed (their
kernel is >= 0), so the layer divides by max(den, eps).
"""

from __future__ import annotations


import torch
from torch import nn

from ..ops.context import AttentionContext
from ..ops.dtypes import accumulation_dtype
from ..ops.linear import Divisor
from .base import FeatureMap, Method
from .ela_options import KERNELS, ELAOptions  # noqa: F401 (KERNELS: read here too)
from .registry import register


class ELAFeatureMap(FeatureMap):
    """One map object for q and k; the key side (context role "key") gets psi."""

    options_class = ELAOptions
    token_wise = False  # exp: the key shift is a max over all real keys of the sequence

    def __init__(self, head_dim: int, num_heads: int, options: ELAOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        # the distance kernels' features and kernel values may be negative
        self.signed_features = self.options.kernel != "exp"
        self.divisor = Divisor.signed() if self.signed_features else Divisor(check=True)
        # exp: a learnable temperature per head, init 1 (no 1/sqrt(d): the paper's code uses raw q, k)
        self.log_temperature = nn.Parameter(torch.zeros(num_heads, 1, 1)) if self.options.kernel == "exp" else None

    @property
    def feature_dim(self) -> int:
        return self.head_dim if self.options.kernel == "exp" else self.head_dim + 2

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        # float32 for half-precision inputs (float64 stays): float16's exp features and |x|^2 overflow, and
        # the gradients of features far below 1 did too (inf at x5 activations)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.features_in(x.to(accumulation_dtype(x)), context)

    def features_in(self, x: torch.Tensor, context: AttentionContext | None) -> torch.Tensor:
        """``forward``'s features of x in x's dtype."""
        is_key = context is not None and context.role == "key"
        mask = None if context is None else context.view_mask
        if self.options.kernel == "exp":
            z = x * torch.exp(-self.log_temperature.to(x.dtype))
            if not is_key:
                return torch.exp(z - z.amax(-1, keepdim=True).detach())
            real = None if mask is None else mask[:, None, :, None]
            masked = z if real is None else z.masked_fill(~real, float("-inf"))
            shift = masked.amax(dim=(-2, -1), keepdim=True).detach()  # one per example and head
            if real is not None:  # an all-padding example has no real key: -inf - -inf is NaN, in every gradient
                shift = shift.masked_fill(torch.isinf(shift), 0.0)
            feats = torch.exp(masked - shift)  # pads: exp(-inf) = 0, never inf * 0
            return feats
        sq = x.square().sum(-1, keepdim=True)
        ones = torch.ones_like(sq)
        if not is_key:
            return torch.cat([x, sq, ones], -1)
        sign = 2.0 if self.options.kernel == "l2sum" else -2.0
        return torch.cat([sign * x, ones, sq], -1)


ELA = register(Method(
    name="ela", core=ELAFeatureMap, distill=True,
    description="ELA: exact finite-feature kernels, Hadamard-exp or squared Euclidean distances (arXiv 2605.18848)",
    paper="Exact Linear Attention (ELA), arXiv 2605.18848; code yauntyour/Exact-Linear-Attention "
          "(authorship unconfirmed)",
    details="""Confirmed (paper and code): Hadamard-exp kernel sum_d exp(q_d) exp(k_d) on raw q, k (no 1/sqrt(d));
||q+k||^2 with phi = [q, ||q||^2, 1], psi = [2k, 1, ||k||^2]; ||q-k||^2 with psi = [-2k, 1, ||k||^2]; rows
divided by the clamped sum (clamp min 1e-8 in the code). Derived: the kernel is option kernel (default
'exp', the paper's recommendation); a learnable per-head temperature tau for exp (init 1, so the initial
kernel is the paper's); the exp stabiliser (a per-query max over d, which cancels, and one max over real
keys and dims for keys); pads masked (the code has no padding mask); the squared-distance rows divided by
max(den, eps) (option eps, 1e-12 here: shifted exp features can have row sums far below 1). ELA's Hyper-Link residual, Memory Lobe and MoE bias are out of scope (they
change the architecture). ELA's kernel is not an approximation of softmax. Recipe (derived): distil
attention against softmax, then finetune.""",
))
