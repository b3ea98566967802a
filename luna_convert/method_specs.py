"""The conversion methods: a feature map plus the defaults and recipe it comes with."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import unknown_name


@dataclass(frozen=True)
class Method:
    name: str
    feature_map: str
    description: str
    defaults: dict = field(default_factory=dict)  # LinearAttention / feature-map options
    distill: bool = False  # the method's recipe distils attention before finetuning


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method(
            "luna",
            "luna",
            "LUNA: learned projections + a bank of learned scalar channel functions, DWC branch (Shahbazi et al. 2025)",
            {"projections": 8, "channels": 8, "hidden": 64, "shared_channels": False, "envelope": False,
             "channel_bank": "mlp", "channel_init": "random", "per_head_projections": False,
             "projection_init": "random", "feature_norm": "none", "exp_rate": 0.5,
             "dwc": True, "dwc_kernel": 3},
        ),
        Method("t2r", "t2r", "T2R: ReLU(Wx + b) features, finetune only (Kasai et al. 2021)",
               {"feature_dim": 64, "dwc": False}),
        Method("t2r-hh", "t2r-hh", "T2R features trained with Hedgehog's recipe: distil attention, then finetune",
               {"feature_dim": 64, "dwc": False}, distill=True),
        Method("hedgehog", "hedgehog",
               "Hedgehog: [softmax(Wx+b), softmax(-(Wx+b))] per head, W=I; distil, then finetune (Zhang et al. 2024)",
               {"dwc": False}, distill=True),
    ]
}

# Options read by LinearAttention itself; the rest go to the feature map.
ATTENTION_OPTIONS = ("dwc", "dwc_kernel", "eps")


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise unknown_name("method", name, METHODS)
    return METHODS[name]


def methods() -> dict[str, str]:
    """Method name -> one-line description."""
    return {name: m.description for name, m in METHODS.items()}
