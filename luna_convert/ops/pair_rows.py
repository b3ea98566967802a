"""Pair features made inside the core's native products (``pair_rows.c``), float32 on the CPU at inference:
[1, a x, the pairs of x x^T (the diagonal times s, the rest times p)], the form of Taylor's map and of the
self-tensored sketch of LLoPS. D grows as w^2 / 2 (Taylor's 2,145 at w = 64: stored, 33 times the memory of
its inputs, and above 32 MiB the layer streams them in chunks); made a block of tokens at a time inside the
products, they never go to memory. The same values to the bit as the maps' PyTorch forwards, the
references (tests/test_produced_rows.py). Where ``ops.native`` cannot build the library the maps store their
features as before.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import native
from .products import ProducedRows

SOURCE = Path(__file__).with_name("pair_rows.c")
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
# state, x, heads, x's strides (batch, head, token), w, constant, linear, the linear, square and pair scales
_SIGNATURES = {"pair_rows_state": [_P, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32, _F, _F, _F]}


def library() -> ctypes.CDLL | None:
    """The compiled source, or None (``ops.native.unavailable_reason(SOURCE)`` says why)."""
    return native.load_library(SOURCE, _SIGNATURES)


def pair_feature_count(width: int, constant: bool, linear: bool) -> int:
    return int(constant) + (width if linear else 0) + width * (width + 1) // 2


def pair_feature_rows(x: torch.Tensor, square_scale: float, pair_scale: float, constant: bool = False,
                      linear_scale: float | None = None) -> ProducedRows:
    """For x [B, H, N, w] (float32, any strides but a last of 1), the features [1 (``constant``), x_i
    ``linear_scale`` (unless None), then per i (x_i ``square_scale``) x_i and (x_i ``pair_scale``) x_j for j > i]
    as ``ops.products.ProducedRows`` [B, H, N, D]. The scales are rounded to float32, as torch rounds a Python
    scalar that multiplies a float32 tensor. No gradients."""
    b, h, n, width = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    linear = linear_scale is not None
    return ProducedRows.made_by(library(), "pair_rows", (b, h, n, pair_feature_count(width, constant, linear)), (x,),
                                x.data_ptr(), h, x.stride(0), x.stride(1), x.stride(2), width, int(constant),
                                int(linear), linear_scale if linear else 0.0, square_scale, pair_scale)
