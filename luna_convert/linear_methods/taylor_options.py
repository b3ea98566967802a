"""The Taylor map's options (no torch; the method itself is in ``taylor.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import AttentionOptions, option
from .registry import declare_options


@dataclass
class TaylorOptions(AttentionOptions):
    project_dim: int = option(0, "derived: d', project q and k to d' dims per head first (learned, random "
                              "orthonormal init; Based uses 16); 0 = no projection")

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.project_dim, bool) or not isinstance(self.project_dim, int) or self.project_dim < 0:
            raise ValueError(f"project_dim must be a non-negative integer, got {self.project_dim!r}")


declare_options(TaylorOptions, "taylor")
