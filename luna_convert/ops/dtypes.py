"""The dtype attention sums accumulate in."""

from __future__ import annotations

import torch


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (bf16/fp16 inputs accumulate in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
