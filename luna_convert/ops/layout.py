"""Features built tokens last, handed on tokens first.

Taylor and LLoPS build their pair features as whole rows of a [.., D, N] tensor (selecting rows is about
3x faster than gathering single elements along the last axis) and hand the core its [.., N, D] view. The
core's gradient for that view comes back contiguous in [.., N, D], so the map's backward (the pair
products' ``mul``, ``index_select``'s ``index_add_``) read it across rows: in the profiler LLoPS's layer
spent 59 ms of its forward + backward in ``index_add_`` alone at 4,096 tokens, and 9 ms once the gradient
is copied to the build's layout first (docs/design-decisions.md, *Feature maps*).
"""

from __future__ import annotations

import torch


class _ContiguousGradient(torch.autograd.Function):
    """The identity; its backward hands on the gradient made contiguous (one copy)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def tokens_first(features: torch.Tensor) -> torch.Tensor:
    """The [.., N, D] view of features built as [.., D, N], whose gradient reaches the code that built them
    contiguous in [.., D, N], the layout it was built in."""
    return _ContiguousGradient.apply(features).transpose(-1, -2)
