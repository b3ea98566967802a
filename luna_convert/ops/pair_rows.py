"""Pair features made inside the core's native products (``pair_rows.c``), float32 on the CPU at inference:
[1, a x, the pairs of x x^T (the diagonal times s, the rest times p)], the form of Taylor's map and of the
self-tensored sketch of LLoPS. D grows as w^2 / 2 (Taylor's 2,145 at w = 64: stored, 33 times the memory of
its inputs, and above 32 MiB the layer streams them in chunks); made a block of tokens at a time inside the
products, they never go to memory. The same values to the bit as the maps' PyTorch forwards, the
references (tests/test_produced_rows.py). x is read from memory, or made by another maker: LLoPS's sketch
(``factor_product_rows``) from its projections (``products.affine_feature_rows``), so that not even the sketch
is stored. Where ``ops.native`` cannot build the library the maps store their features as before.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import native, products
from .products import ProducedRows

SOURCE = Path(__file__).with_name("pair_rows.c")
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_SIGNATURES = {
    # state, x, heads, x's strides (batch, head, token), w, constant, linear, the linear, square and pair scales,
    # and where x is NULL, its maker and the maker's state
    "pair_rows_state": [_P, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32, _F, _F, _F, _P, _P],
    "factor_product_rows_state": [_P, _P, _P, _I32, _I32, _F],  # state, the source's maker and state, factors, w, scale
}


def library() -> ctypes.CDLL | None:
    """The compiled source, or None (``ops.native.unavailable_reason(SOURCE)`` says why)."""
    return native.load_library(SOURCE, _SIGNATURES)


def rows_apply(*tensors: torch.Tensor) -> bool:
    """Whether a map may hand these (its inputs and parameters) to the products as rows this library's makers
    make: ``products.produced_rows_apply``, and the library built."""
    return products.produced_rows_apply(*tensors) and library() is not None


def pair_feature_count(width: int, constant: bool, linear: bool) -> int:
    return int(constant) + (width if linear else 0) + width * (width + 1) // 2


def pair_feature_rows(x: torch.Tensor | ProducedRows, square_scale: float, pair_scale: float, constant: bool = False,
                      linear_scale: float | None = None) -> ProducedRows:
    """For x [B, H, N, w] (float32, any strides but a last of 1; or rows another maker makes), the features [1
    (``constant``), x_i ``linear_scale`` (unless None), then per i (x_i ``square_scale``) x_i and (x_i
    ``pair_scale``) x_j for j > i] as ``ops.products.ProducedRows`` [B, H, N, D]. The scales are rounded to
    float32, as torch rounds a Python scalar that multiplies a float32 tensor. No gradients."""
    b, h, n, width = x.shape
    linear = linear_scale is not None
    shape = (b, h, n, pair_feature_count(width, constant, linear))
    scales = (int(constant), int(linear), linear_scale if linear else 0.0, square_scale, pair_scale)
    if isinstance(x, ProducedRows):
        return ProducedRows.made_by(library(), "pair_rows", shape, (x,), None, h, 0, 0, 0, width, *scales, x.function,
                                    ctypes.addressof(x.state))
    if x.stride(-1) != 1:
        x = x.contiguous()
    return ProducedRows.made_by(library(), "pair_rows", shape, (x,), x.data_ptr(), h, x.stride(0), x.stride(1),
                                x.stride(2), width, *scales, None, None)


def factor_product_rows(z: ProducedRows, factors: int, scale: float) -> ProducedRows:
    """psi [..., w] = (z_1 z_2 ... z_factors) ``scale`` for the rows z [..., factors w] that another maker makes,
    z_f its f-th block of w columns, multiplied in factor order, then scaled (LLoPS's sketch from its
    projections), itself made a block of tokens at a time. No gradients."""
    width = z.shape[-1] // factors
    if width * factors != z.shape[-1]:
        raise ValueError(f"{z.shape[-1]} columns do not split into {factors} factors")
    return ProducedRows.made_by(library(), "factor_product_rows", (*z.shape[:-1], width), (z,), z.function,
                                ctypes.addressof(z.state), factors, width, scale)
