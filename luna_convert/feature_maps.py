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
class ScalarChannels(nn.Module):
    """A bank of L learned scalar functions psi_l: R -> R_{>=0}.

    Each psi_l is a 1 -> hidden -> 1 ReLU MLP with a ReLU on the output
    (the paper's "nonneg"). With ``shared=True`` one MLP 1 -> hidden -> L
    produces all channels from a single hidden layer.

    Each channel is piecewise linear in u with ``hidden`` breakpoints; the
    fast path in :mod:`luna_convert.kernels` uses that fact. ``forward`` here
    is the plain reference.
    """

    def __init__(self, channels: int, hidden: int, shared: bool = False):
        super().__init__()
        self.channels, self.hidden, self.shared = channels, hidden, shared
        rows = 1 if shared else channels
        # Same scale as nn.Linear's default init (fan_in 1, then fan_in hidden).
        self.w1 = nn.Parameter(torch.empty(rows, hidden).uniform_(-1.0, 1.0))
        self.b1 = nn.Parameter(torch.empty(rows, hidden).uniform_(-1.0, 1.0))
        bound = 1.0 / math.sqrt(hidden)
        self.w2 = nn.Parameter(torch.empty(channels, hidden).uniform_(-bound, bound))
        self.b2 = nn.Parameter(torch.empty(channels).uniform_(-bound, bound))

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

    W and b are shared across heads (as in the paper's listing); one map for
    q and k so the kernel stays positive definite.
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
        fast: bool = True,
    ):
        super().__init__(head_dim, num_heads)
        if channel_bank not in CHANNEL_BANKS:
            raise ValueError(f"unknown channel_bank {channel_bank!r}; choose one of {sorted(CHANNEL_BANKS)}")
        self.projections, self.channels, self.fast = projections, channels, fast
        self.proj = nn.Linear(head_dim, projections)
        nn.init.normal_(self.proj.weight, std=head_dim**-0.5)
        nn.init.zeros_(self.proj.bias)
        bank = CHANNEL_BANKS[channel_bank]
        self.psi = bank(channels=channels, hidden=hidden, shared=shared_channels) if bank is ScalarChannels \
            else bank(channels=channels)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.proj(x)  # [B, H, N, M]
        if self.uses_kernel:
            from .kernels import scalar_channels

            # 1/sqrt(M) folded into the kernel's tables: no extra pass over the features.
            feats = scalar_channels(u, self.psi, scale=1.0 / math.sqrt(self.projections))
        else:
            feats = self.psi(u) / math.sqrt(self.projections)  # [B, H, N, M, L]
        if self.envelope is not None:
            feats = feats * torch.sigmoid(self.envelope(x))[..., None, :]
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
