"""What an op needs to know of its inputs: the dtype its sums accumulate in, whether autograd records them."""

from __future__ import annotations

import torch


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (bf16/fp16 inputs accumulate in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records this call: grad mode on and any of ``tensors`` requiring a gradient."""
    return torch.is_grad_enabled() and any([t.requires_grad for t in tensors])  # a list: what graphs trace
