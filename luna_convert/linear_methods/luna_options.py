"""LUNA's options (no torch; the method itself is in ``luna.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from .options import AttentionOptions, check_choice, check_positive_int, option
from .registry import declare_options

# channel_init "exp": the channels interpolate exp(c u) on [-span, span]: EXP_INIT_SPAN for a bank built
# alone, WIDE_EXP_SPAN in the conversion default (0.85 % of MiniLM's first-layer q, k lie past 4).
EXP_INIT_SPAN = 4.0
WIDE_EXP_SPAN = 8.0
CHANNEL_INITS = ("random", "exp")
PROJECTION_INITS = ("random", "identity")
FEATURE_NORMS = ("none", "channel")
CHANNEL_BANK_NAMES = ("mlp", "fourier", "bank")  # luna.CHANNEL_BANKS: the bank of each


def check_channel_init(init: str) -> None:
    check_choice("channel_init", init, CHANNEL_INITS)


def check_fourier_channels(channels: int) -> None:
    if channels % 2:
        raise ValueError("the fourier channel bank needs an even number of channels L")


@dataclass
class LunaOptions(AttentionOptions):
    projections: int | None = option(None, "M, learned projections w_i^T x + b_i per token; null: head_dim "
                                     "(the conversion default; the paper uses 8)")
    channels: int = option(2, "L, scalar channel functions per projection; D = M x L (conversion default 2, "
                           "paper 8)")
    hidden: int = option(64, "hidden units of each channel MLP, i.e. its knots (paper listing: 64)")
    shared_channels: bool = option(False, "one 1 -> hidden -> L MLP for all channels (the listing's shared variant)")
    envelope: bool = option(False, "envelope gate h(x) in [0, 1]^L from the token (an ablated variant)")
    channel_bank: str = option("mlp", "mlp (learned MLPs), fourier (fixed sin/cos) or bank (fixed basis, "
                               "learned weights): the paper's ablations")
    channel_init: str = option("exp", "channel_bank mlp: exp (derived: channels start at exp(c u)) or random "
                               "(the MLP default init, the paper's)")
    per_head_projections: bool = option(True, "derived: one W, b per head (the paper's listing shares them over "
                                        "heads: false)")
    projection_init: str = option("identity", "identity (derived: projection i reads coordinate i mod d, W = I "
                                  "when M = d) or random (randn / sqrt(d), the paper's)")
    exp_rate: float = option(1.0, "channel_init exp: the rates are +-exp_rate, +-2 exp_rate, ... (derived)")
    exp_span: float = option(WIDE_EXP_SPAN, "channel_init exp: the knots cover [-exp_span, exp_span]; past the "
                             "top knot a channel grows linearly, not exponentially (derived; 8 holds MiniLM's "
                             "first-layer q and k, 4 did not)")
    separate_key_map: bool = option(True, "derived: a second map (W, b, channels) for keys, as Hedgehog has; "
                                    "false: one map for q and k (the paper's, a positive-definite kernel)")
    feature_norm: str = option("channel", "none (the paper's), or channel (derived): each channel's features sum to 1 over the "
                               "projections, per token (with exp(+-u) channels and W = I: Hedgehog's softmax pair)")
    fast: bool = option(True, "evaluate the mlp bank from sorted knots (same values as the MLP, less memory)")
    channel_lr_scale: float = option(0.1, "derived: the channel functions' learning rate relative to the "
                                     "projections' (Adam moves every knot parameter by about lr per step, "
                                     "which at the full rate unshapes the exp init; 1: one rate)")

    # Folders saved before these options existed were converted with the paper's form (DWC on).
    saved_before: ClassVar[Mapping[str, Any]] = MappingProxyType({
        "dwc": True, "channel_init": "random", "per_head_projections": False, "projection_init": "random",
        "exp_rate": 0.5, "feature_norm": "none", "channel_lr_scale": 1.0, "exp_span": EXP_INIT_SPAN,
        "separate_key_map": False})

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "channels", "hidden")
        if self.projections is not None:
            check_positive_int(self, "projections")
        check_choice("channel_bank", self.channel_bank, CHANNEL_BANK_NAMES)
        check_channel_init(self.channel_init)
        if self.channel_bank == "fourier":
            check_fourier_channels(self.channels)
        check_choice("projection_init", self.projection_init, PROJECTION_INITS)
        check_choice("feature_norm", self.feature_norm, FEATURE_NORMS)
        for name in ("exp_rate", "exp_span", "channel_lr_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")


declare_options(LunaOptions, "luna")
