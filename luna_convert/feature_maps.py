"""Feature maps phi: R^d -> R^D for kernel (linear) attention.

One small module per map, registered by name. Every map takes per-head
inputs shaped [batch, heads, tokens, head_dim] and returns non-negative
features shaped [batch, heads, tokens, D].

Class attributes tell the attention module how to use a map:
  shared_qk      one map for queries and keys (False: a second copy for keys)
  prescale_query multiply q by head_dim**-0.5 before the map (T2R)
  stream_when_training  long inputs go through the map in chunks of tokens
                 (``kernels.streamed_linear_attention``) at inference always (maps
                 must be token-wise), and in training too unless this is False
"""

from __future__ import annotations

import abc
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

FEATURE_MAPS: dict[str, type["FeatureMap"]] = {}


def register_feature_map(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        FEATURE_MAPS[name] = cls
        cls.name = name
        return cls

    return wrap


class FeatureMap(nn.Module, abc.ABC):
    name: str = ""
    shared_qk: bool = True
    prescale_query: bool = False
    stream_when_training: bool = True

    def __init__(self, head_dim: int, num_heads: int):
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = num_heads

    @property
    @abc.abstractmethod
    def feature_dim(self) -> int:
        """D, the number of features per head."""


# --------------------------------------------------------------------------- LUNA
# channel_init "exp": the channels interpolate exp(c u) on [-EXP_INIT_SPAN, EXP_INIT_SPAN].
EXP_INIT_SPAN = 4.0
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
    fast path in :mod:`luna_convert.kernels` uses that fact. ``forward`` here
    is the plain reference.
    """

    def __init__(self, channels: int, hidden: int, shared: bool = False, init: str = "random",
                 exp_rate: float = 0.5):
        super().__init__()
        self.channels, self.hidden, self.shared = channels, hidden, shared
        rows = 1 if shared else channels
        # Same scale as nn.Linear's default init (fan_in 1, then fan_in hidden).
        self.w1 = nn.Parameter(torch.empty(rows, hidden).uniform_(-1.0, 1.0))
        self.b1 = nn.Parameter(torch.empty(rows, hidden).uniform_(-1.0, 1.0))
        bound = 1.0 / math.sqrt(hidden)
        self.w2 = nn.Parameter(torch.empty(channels, hidden).uniform_(-bound, bound))
        self.b2 = nn.Parameter(torch.empty(channels).uniform_(-bound, bound))
        if init == "exp":
            if shared:
                raise ValueError("channel_init 'exp' needs one hidden layer per channel (shared_channels false)")
            self.init_exponential(exp_rate)
        elif init != "random":
            raise ValueError(f"unknown channel_init {init!r}; choose 'random' or 'exp'")

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
            sign = 1.0 if c > 0 else -1.0
            # v = sign * u is the variable in which exp(|c| v) increases; unit j is relu(v - t_j).
            target = torch.exp(abs(c) * knots)  # values at the knots, in v
            slopes = (target[1:] - target[:-1]) / (knots[1:] - knots[:-1])  # [hidden - 1]
            self.w1[l] = sign
            self.b1[l] = -knots
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

    def __init__(self, channels: int, **_):
        super().__init__()
        if channels % 2:
            raise ValueError("the fourier channel bank needs an even number of channels L")
        self.channels = channels
        self.register_buffer("freq", torch.randn(channels // 2))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        angle = u[..., None] * self.freq
        # sin/cos features are signed; shift by 1 so features stay >= 0 and the
        # linear-attention denominator stays positive.
        return torch.cat([1 + torch.sin(angle), 1 + torch.cos(angle)], -1) / math.sqrt(2)


class BankCoefficientChannels(nn.Module):
    """Ablation: a fixed basis of non-negative scalar functions with learned global weights."""

    def __init__(self, channels: int, **_):
        super().__init__()
        self.channels = channels
        self.register_buffer("centres", torch.linspace(-2.0, 2.0, channels))
        self.coef = nn.Parameter(torch.ones(channels))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        basis = torch.exp(-0.5 * (u[..., None] - self.centres) ** 2)  # Gaussian bumps
        return basis * F.softplus(self.coef)


CHANNEL_BANKS = {"mlp": ScalarChannels, "fourier": FixedFourierChannels, "bank": BankCoefficientChannels}


@register_feature_map("luna")
class LunaFeatureMap(FeatureMap):
    """phi(x) = h(x)/sqrt(M) * [psi_l(w_i^T x + b_i)]_{i<=M, l<=L}  (LUNA, Eq. 11).

    W and b are shared across heads (as in the paper's listing) unless
    ``per_head_projections`` (a derived option: one W, b per head, as Hedgehog
    has one Linear per head); one map for q and k so the kernel stays positive
    definite. ``channel_init`` "exp" starts the channel bank at exponentials
    (see ``ScalarChannels.init_exponential``), "random" at the MLP default.
    """

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        projections: int = 8,
        channels: int = 8,
        hidden: int = 64,
        shared_channels: bool = False,
        envelope: bool = False,
        channel_bank: str = "mlp",
        channel_init: str = "random",
        per_head_projections: bool = False,
        projection_init: str = "random",
        feature_norm: str = "none",
        exp_rate: float = 0.5,
        fast: bool = True,
    ):
        super().__init__(head_dim, num_heads)
        if channel_bank not in CHANNEL_BANKS:
            raise ValueError(f"unknown channel_bank {channel_bank!r}; choose one of {sorted(CHANNEL_BANKS)}")
        if channel_init != "random" and channel_bank != "mlp":
            raise ValueError(f"channel_init {channel_init!r} applies to channel_bank 'mlp' only")
        if feature_norm not in ("none", "channel"):
            raise ValueError(f"unknown feature_norm {feature_norm!r}; choose 'none' or 'channel'")
        self.feature_norm = feature_norm
        if projection_init not in ("random", "identity"):
            raise ValueError(f"unknown projection_init {projection_init!r}; choose 'random' or 'identity'")
        if projection_init == "identity" and projections != head_dim:
            raise ValueError(f"projection_init 'identity' needs projections == head_dim ({head_dim}), got {projections}")
        self.projections, self.channels, self.fast = projections, channels, fast
        if per_head_projections:
            # [H, d, M] and [H, 1, M]: u = x W_h + b_h per head; same init as the shared Linear.
            self.proj = None
            self.head_proj_weight = nn.Parameter(torch.randn(num_heads, head_dim, projections) * head_dim**-0.5)
            self.head_proj_bias = nn.Parameter(torch.zeros(num_heads, 1, projections))
        else:
            self.proj = nn.Linear(head_dim, projections)
            nn.init.normal_(self.proj.weight, std=head_dim**-0.5)
            nn.init.zeros_(self.proj.bias)
        if projection_init == "identity":  # u = x: each projection reads one coordinate, as Hedgehog's W = I
            with torch.no_grad():
                if self.proj is None:
                    self.head_proj_weight.copy_(torch.eye(head_dim).expand(num_heads, -1, -1))
                else:
                    self.proj.weight.copy_(torch.eye(head_dim))
        bank = CHANNEL_BANKS[channel_bank]
        self.psi = bank(channels=channels, hidden=hidden, shared=shared_channels, init=channel_init,
                        exp_rate=exp_rate) \
            if bank is ScalarChannels else bank(channels=channels)
        # Envelope h(x) in [0, 1]^L, one gate per channel, from the token itself.
        self.envelope = nn.Linear(head_dim, channels) if envelope else None

    @property
    def feature_dim(self) -> int:
        return self.projections * self.channels

    @property
    def uses_kernel(self) -> bool:
        return self.fast and isinstance(self.psi, ScalarChannels)

    @property
    def stream_when_training(self) -> bool:
        # The channel kernel already works in cache-sized chunks and saves little for
        # backward; recomputing it chunk by chunk costs more than it saves (16k tokens,
        # forward + backward: 730 vs 630 ms).
        return not self.uses_kernel

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """u = W x + b: [B, H, N, d] -> [B, H, N, M]."""
        if self.proj is not None:
            return self.proj(x)
        return torch.matmul(x, self.head_proj_weight) + self.head_proj_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.project(x)  # [B, H, N, M]
        if self.uses_kernel:
            from .kernels import scalar_channels

            # 1/sqrt(M) folded into the kernel's tables: no extra pass over the features.
            feats = scalar_channels(u, self.psi, scale=1.0 / math.sqrt(self.projections))
        else:
            feats = self.psi(u) / math.sqrt(self.projections)  # [B, H, N, M, L]
        if self.envelope is not None:
            feats = feats * torch.sigmoid(self.envelope(x))[..., None, :]
        if self.feature_norm == "channel":
            # Each channel's features sum to 1 over the projections (per token): with exp channels
            # exp(+-u) and W = I this is Hedgehog's pair of softmaxes; for keys it stops a key's
            # overall size from deciding its weight (for queries it cancels in the normalisation).
            feats = feats / (feats.sum(-2, keepdim=True) + FEATURE_NORM_EPS)
        return feats.flatten(-2)


# ---------------------------------------------------------------------------- T2R
@register_feature_map("t2r")
class T2RFeatureMap(FeatureMap):
    """phi(x) = ReLU(W x + b), one Linear(d, D) per layer shared by heads, q and k (Kasai et al. 2021)."""

    prescale_query = True

    def __init__(self, head_dim: int, num_heads: int, feature_dim: int = 64):
        super().__init__(head_dim, num_heads)
        self.proj = nn.Linear(head_dim, feature_dim)

    @property
    def feature_dim(self) -> int:
        return self.proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.proj(x))


@register_feature_map("t2r-hh")
class T2RHedgehogFeatureMap(T2RFeatureMap):
    """The T2R map, trained with Hedgehog's recipe (distil attention, then finetune)."""


# ------------------------------------------------------------------------ Hedgehog
@register_feature_map("hedgehog")
class HedgehogFeatureMap(FeatureMap):
    """phi(x) = [softmax(W x + b), softmax(-(W x + b))] per head, W = I at init (Zhang et al. 2024).

    Two separate softmaxes over d (not one over 2d); separate maps for q and k.
    """

    shared_qk = False

    def __init__(self, head_dim: int, num_heads: int):
        super().__init__(head_dim, num_heads)
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1))  # [H, d, d]
        self.bias = nn.Parameter(torch.zeros(num_heads, 1, head_dim))

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("bhnd,hed->bhne", x, self.weight) + self.bias
        return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


def build_feature_map(name: str, head_dim: int, num_heads: int, **options) -> FeatureMap:
    if name not in FEATURE_MAPS:
        raise KeyError(name)
    return FEATURE_MAPS[name](head_dim, num_heads, **options)
