"""LUNA: Linear Universal Neural Attention (Shahbazi et al. 2025; the seed paper, Eq. 11 and Listing 1).

phi(x) = h(x)/sqrt(M) * [psi_l(w_i^T x + b_i)]_{i <= M, l <= L}: M learned projections, each
passed through a bank of L learned non-negative scalar functions psi_l (small ReLU MLPs), plus a
depthwise-convolution branch on V. Not "Luna: Linear Unified Nested Attention" (Ma et al. 2021).
"""

from __future__ import annotations

import contextlib
import math
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.context import AttentionContext
from ..ops.normalize import sum_normalize
from .base import FeatureMap, Method
from .luna_kernel import channel_features_of, frozen_for_export, projected_channel_features_of, scalar_channels_of
from .luna_options import (CHANNEL_BANK_NAMES, EXP_INIT_SPAN, LunaOptions, check_channel_init,
                           check_fourier_channels)
from .registry import register

# feature_norm "channel": keeps a token whose channel is zero on every projection at zero features.
FEATURE_NORM_EPS = 1e-6


def exp_rates(channels: int, base: float = 0.5) -> torch.Tensor:
    """Rates c_l of the exponential channel init: +-base, +-2 base, +-3 base, ... (pairs of opposite
    sign, as Hedgehog's [exp(z), exp(-z)]), so the bank holds several temperatures of both directions."""
    magnitude = base * (torch.arange(channels, dtype=torch.float64) // 2 + 1)
    sign = 1.0 - 2.0 * (torch.arange(channels) % 2)
    return magnitude * sign


class ScalarChannels(nn.Module):
    """A bank of L learned scalar functions psi_l: R -> R_{>=0}.

    Each psi_l is a 1 -> hidden -> 1 ReLU MLP with a ReLU on the output
    (the paper's "nonneg"). With ``shared=True`` one MLP 1 -> hidden -> L
    produces all channels from a single hidden layer.

    Each channel is piecewise linear in u with ``hidden`` breakpoints; the
    fast path in :mod:`luna_convert.linear_methods.luna_kernel` uses that fact.
    ``forward`` here is the plain reference.
    """

    def __init__(self, channels: int, hidden: int, shared: bool = False, init: str = "random",
                 exp_rate: float = 0.5, exp_span: float = EXP_INIT_SPAN):
        super().__init__()
        check_channel_init(init)
        self.channels, self.hidden, self.shared = channels, hidden, shared
        rows = 1 if shared else channels
        # Same scale as nn.Linear's default init (fan_in 1, then fan_in hidden).
        self.w1 = nn.Parameter(torch.empty(rows, hidden).uniform_(-1.0, 1.0))
        self.b1 = nn.Parameter(torch.empty(rows, hidden).uniform_(-1.0, 1.0))
        bound = 1.0 / math.sqrt(hidden)
        self.w2 = nn.Parameter(torch.empty(channels, hidden).uniform_(-bound, bound))
        self.b2 = nn.Parameter(torch.empty(channels).uniform_(-bound, bound))
        if init == "exp":
            self.init_exponential(exp_rate, exp_span)

    @torch.no_grad()
    def init_exponential(self, base_rate: float = 0.5, span: float = EXP_INIT_SPAN) -> None:
        """Each channel the piecewise-linear interpolant of exp(c_l * u) on [-span, span].

        The rates c_l alternate in sign and grow in size over the channels
        (``exp_rates``): softmax's exponential is a special case of the bank
        (LUNA paper, Sec. 1), so a converted model starts from exponential
        features rather than random ones. Knots sit at ``hidden`` evenly spaced
        points; below the first knot the channel is constant, above the last it
        continues with the last slope.
        """
        rates = exp_rates(self.channels, base_rate).to(self.w1)
        knots = torch.linspace(-span, span, self.hidden).to(self.w1)  # [hidden]
        for l, c in enumerate(rates.tolist()):
            # Unit j is relu(v - t_j) in v = sign * u. One hidden layer per channel: v rises with the
            # channel's exponential, so it keeps rising past either end of the span. A shared layer has
            # one v = u for all channels; a falling exponential is then constant left of the span.
            sign = 1.0 if c > 0 or self.shared else -1.0
            target = torch.exp(c * sign * knots)  # the channel's values at the knots, in v
            slopes = (target[1:] - target[:-1]) / (knots[1:] - knots[:-1])  # [hidden - 1]
            row = 0 if self.shared else l
            self.w1[row] = sign
            self.b1[row] = -knots
            self.w2[l, 0] = slopes[0]
            self.w2[l, 1:-1] = slopes[1:] - slopes[:-1]
            self.w2[l, -1] = 0.0
            self.b2[l] = target[0]

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u: [..., M] -> [..., M, L]"""
        hidden = F.relu(u[..., None, None] * self.w1 + self.b1)  # [..., M, rows, hidden]
        out = (hidden * self.w2).sum(-1) + self.b2  # [..., M, L]
        return F.relu(out)


class FixedFourierChannels(nn.Module):
    """Ablation: fixed sin/cos features of u (random fixed frequencies)."""

    def __init__(self, channels: int):
        super().__init__()
        check_fourier_channels(channels)
        self.channels = channels
        self.register_buffer("freq", torch.randn(channels // 2))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        angle = u[..., None] * self.freq
        # sin/cos features are signed; shift by 1 so features stay >= 0 and the
        # linear-attention denominator stays positive.
        return torch.cat([1 + torch.sin(angle), 1 + torch.cos(angle)], -1) / math.sqrt(2)


class BankCoefficientChannels(nn.Module):
    """Ablation: a fixed basis of non-negative scalar functions with learned global weights."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels = channels
        self.register_buffer("centres", torch.linspace(-2.0, 2.0, channels))
        self.coef = nn.Parameter(torch.ones(channels))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        basis = torch.exp(-0.5 * (u[..., None] - self.centres) ** 2)  # Gaussian bumps
        return basis * F.softplus(self.coef)


CHANNEL_BANKS = dict(zip(CHANNEL_BANK_NAMES, (ScalarChannels, FixedFourierChannels, BankCoefficientChannels)))


# The paper's form (Eq. 11, Listing 1) in these options: `convert(model, "luna", **PAPER_OPTIONS)`.
PAPER_OPTIONS = MappingProxyType({"projections": 8, "channels": 8, "per_head_projections": False,
                                  "projection_init": "random", "channel_init": "random", "feature_norm": "none",
                                  "channel_lr_scale": 1.0, "separate_key_map": False, "dwc": True})


class LunaFeatureMap(FeatureMap):
    """phi(x) = h(x)/sqrt(M) * [psi_l(w_i^T x + b_i)]_{i<=M, l<=L}  (LUNA, Eq. 11).

    W and b are shared across heads (as in the paper's listing) unless
    ``per_head_projections`` (a derived option: one W, b per head, as Hedgehog
    has one Linear per head); one map for q and k so the kernel stays positive
    definite. ``channel_init`` "exp" starts the channel bank at exponentials
    (see ``ScalarChannels.init_exponential``), "random" at the MLP default.
    """

    options_class = LunaOptions
    context_free = True

    def __init__(self, head_dim: int, num_heads: int, options: LunaOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        o = self.options
        projections = o.projections or head_dim
        self.projections, self.channels, self.fast = projections, o.channels, o.fast
        if o.per_head_projections:
            # [H, d, M] and [H, 1, M]: u = x W_h + b_h per head; same init as the shared Linear.
            self.proj = None
            self.head_proj_weight = nn.Parameter(torch.randn(num_heads, head_dim, projections) * head_dim**-0.5)
            self.head_proj_bias = nn.Parameter(torch.zeros(num_heads, 1, projections))
        else:
            self.proj = nn.Linear(head_dim, projections)
            nn.init.normal_(self.proj.weight, std=head_dim**-0.5)
            nn.init.zeros_(self.proj.bias)
        if o.projection_init == "identity":
            # Projection i reads coordinate i mod d (W = I when M = d, as Hedgehog's init).
            picks = torch.eye(head_dim)[torch.arange(projections) % head_dim]  # [M, d]
            with torch.no_grad():
                if self.proj is None:
                    self.head_proj_weight.copy_(picks.T.expand(num_heads, -1, -1))
                else:
                    self.proj.weight.copy_(picks)
        if o.channel_bank == "mlp":
            self.psi = ScalarChannels(o.channels, o.hidden, shared=o.shared_channels, init=o.channel_init,
                                      exp_rate=o.exp_rate, exp_span=o.exp_span)
        else:
            self.psi = CHANNEL_BANKS[o.channel_bank](o.channels)
        # Envelope h(x) in [0, 1]^L, one gate per channel, from the token itself.
        self.envelope = nn.Linear(head_dim, o.channels) if o.envelope else None

    @property
    def feature_dim(self) -> int:
        return self.projections * self.channels

    @property
    def shared_qk(self) -> bool:
        return not self.options.separate_key_map

    def learning_rate_scales(self) -> dict[int, float]:
        scale = self.options.channel_lr_scale
        return {} if scale == 1.0 else {id(p): scale for p in self.psi.parameters()}

    @property
    def uses_kernel(self) -> bool:
        return self.fast and isinstance(self.psi, ScalarChannels)

    @property
    def stream_when_training(self) -> bool:
        # The channel kernel saves little for backward (u, an int16 index, its output);
        # recomputing it chunk by chunk cost more than it saved (16k tokens, forward +
        # backward: 730 vs 630 ms, measured with the kernel's former chunked evaluation).
        return not self.uses_kernel

    def frozen_for_export(self) -> contextlib.AbstractContextManager:
        """The channel bank's knot grid as constants of the exported graph (``luna_kernel.frozen_for_export``)."""
        if not (self.uses_kernel and isinstance(self.psi, ScalarChannels)):
            return contextlib.nullcontext()
        return frozen_for_export(self.psi, 1.0 / math.sqrt(self.projections))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """u = W x + b: [B, H, N, d] -> [B, H, N, M]."""
        if self.proj is not None:
            # Where x is a view of the heads split from [B, N, H*d] (as the adapters pass it), the Linear reads
            # it as it lies, tokens-major, and only the narrow u is left transposed: Linear on the [B, H, N, d]
            # view would first copy all of x.
            tokens_major = x.transpose(1, 2)
            return self.proj(tokens_major).transpose(1, 2) if tokens_major.is_contiguous() else self.proj(x)
        b, h, n, d = x.shape
        # Head-major, one baddbmm (bias fused): [H, B*N, d] is a view of the heads split from [B, N, H*d],
        # and for B = 1 the result is contiguous as it stands (4-D matmul copies x and W, then adds b).
        u = torch.baddbmm(self.head_proj_bias, x.transpose(0, 1).reshape(h, b * n, d), self.head_proj_weight)
        return u.view(h, b, n, -1).transpose(0, 1)

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        return self.each(x)[0]

    def each(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The features of each of ``xs`` (queries and keys), with one set of channel tables for all."""
        fused = self.uses_kernel and self.envelope is None
        # 1/sqrt(M) folded into the kernel's tables, the feature norm into its pass over the tokens.
        norm_eps = FEATURE_NORM_EPS if self.options.feature_norm == "channel" else None
        scale = 1.0 / math.sqrt(self.projections)
        if fused and self.proj is not None:
            # Inference with the shared W: the projection inside the native pass too (None: not here).
            feats = projected_channel_features_of(self.psi, self.proj.weight, self.proj.bias, *xs, scale=scale,
                                                  norm_eps=norm_eps)
            if feats is not None:
                return tuple(f.flatten(-2) for f in feats)
        us = [self.project(x) for x in xs]  # [B, H, N, M] each
        if fused:
            feats = channel_features_of(self.psi, *us, scale=scale, norm_eps=norm_eps)
            return tuple(f.flatten(-2) for f in feats)
        if self.uses_kernel:
            channels = scalar_channels_of(self.psi, *us, scale=scale)
        else:
            channels = [self.psi(u) / math.sqrt(self.projections) for u in us]  # [B, H, N, M, L] each
        return tuple(self.finish(feats, x) for feats, x in zip(channels, xs))

    def finish(self, feats: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Envelope and feature norm of the channel values [B, H, N, M, L] of tokens x; -> [B, H, N, D]."""
        if self.envelope is not None:
            feats = feats * torch.sigmoid(self.envelope(x))[..., None, :]
        if self.options.feature_norm == "channel":
            # Each channel's features sum to 1 over the projections (per token): with exp channels
            # exp(+-u) and W = I this is Hedgehog's pair of softmaxes; for keys it stops a key's
            # overall size from deciding its weight (for queries it cancels in the normalisation).
            feats = sum_normalize(feats, -2, FEATURE_NORM_EPS)
        return feats.flatten(-2)


LUNA = register(Method(
    name="luna",
    core=LunaFeatureMap,
    description="LUNA: learned projections + a bank of learned scalar channel functions "
                "(Shahbazi et al. 2025)",
    paper="Shahbazi et al. 2025, LUNA: Linear Universal Neural Attention (the seed paper, Eq. 11, Listing 1)",
    details="""Confirmed (paper Eq. 11 and Listing 1): phi(x) = h(x)/sqrt(M) [psi_l(w_i^T x + b_i)], W init
randn/sqrt(d), b = 0, shared over tokens and heads; psi_l a 1 -> 64 -> 1 ReLU MLP with a ReLU on the
output; M = L = 8 (D = 64); no envelope by default; the ablated banks (fixed RFF sin/cos, bank +
coefficients, envelope) are options; one map for q and k; the paper's recipe: swap, then finetune, no
distillation.
The conversion defaults here are derived, chosen by measurement (docs/quality.md): the paper's form
recovered less of the teacher than Hedgehog after distillation (attention KL 0.27 vs 0.09 after 60
steps on MiniLM), so the default starts LUNA at softmax's exponential, a special case of its
parameterisation (paper Sec. 1): one W = I per head (M = head_dim, per_head_projections,
projection_init 'identity'), L = 2 channels initialised at exp(+u) and exp(-u) (channel_init 'exp',
exp_rate 1), each channel's features normalised over the projections (feature_norm 'channel'); with these
the map starts equal to Hedgehog's (up to the piecewise-linear channels) and learns its channel
functions on top, at a tenth of the projections' learning rate (channel_lr_scale 0.1: at the full rate
Adam's steps on every knot unshape the exponentials; on the digits ViT, 20 distillation steps reached
0.37 accuracy at the full rate, 0.875 at 0.1). The channels interpolate exp on [-8, 8]
(exp_span; MiniLM's first-layer q and k reach 8.6, and past the top knot a channel only grows
linearly) and keys get a map of their own (separate_key_map, as Hedgehog's): on MiniLM's attention
rows these take the CE after 150 steps from 1.587 to 1.568 (Hedgehog 1.570).
Recipe: distil attention, then finetune everything at train.lr (once LUNA distils from Hedgehog's
kernel, one rate did better on MiniLM SST-2 than train.added_lr 1e-3 for what conversion adds,
0.8630 vs 0.8595, 2 seeds).
The paper's form: --set method_options.projections=8 method_options.channels=8
method_options.per_head_projections=false method_options.projection_init=random
method_options.channel_init=random method_options.feature_norm=none method_options.separate_key_map=false
method_options.channel_lr_scale=1 method_options.dwc=true (and --distill-steps 0).
The DWC branch is off by default: learned only in finetuning, it cost LUNA agreement with the teacher on
held-out RTE pairs in every seed of three (docs/design-decisions.md). Derived: the DWC branch's form
(FLatten-style depthwise conv on V: Conv1d over text tokens with pads zeroed, k x k Conv2d on the ViT patch
grid, prefix tokens none, zero-initialised).""",
    distill=True,
))
