"""Pair features made inside the core's native products (``pair_rows.c``), float32 on the CPU at inference:
[1, a x, the pairs of x x^T (the diagonal times s, the rest times p)], the form of Taylor's map. D grows as
w^2 / 2 (2,145 at w = 64: stored, 33 times the memory of its inputs, and above 32 MiB the layer streams them
in chunks); made a block of tokens at a time inside the products, they never go to memory. The same values to
the bit as the map's PyTorch forward, the reference (tests/test_produced_rows.py). Where ``ops.native`` cannot
build the library the map stores its features. The maker is a declaration (``ops.products.ProducedRows``):
compiled and exported graphs hand it to the made-rows operators, which build it from the run's tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import native, products
from .products import BuiltRows, ProducedRows, made

SOURCE = Path(__file__).with_name("pair_rows.c")


def library() -> native.NativeFunctions | None:
    """The compiled source's functions, or None (``ops.native.unavailable_reason(SOURCE)`` says why)."""
    return native.load_library(SOURCE)


def rows_apply(*tensors: torch.Tensor) -> bool:
    """Whether a map may hand these (its inputs and parameters) to the products as rows this library's makers
    make: ``products.produced_rows_apply``, and the library built."""
    return products.produced_rows_apply(*tensors) and available()


@native.constant_in_graphs
def available() -> bool:
    """Whether the library is built; a constant of a compiled graph (dynamo cannot trace its loading)."""
    return library() is not None


def pair_feature_count(width: int, constant: bool, linear: bool) -> int:
    return int(constant) + (width if linear else 0) + width * (width + 1) // 2


def pair_feature_rows(x: torch.Tensor, square_scale: float, pair_scale: float, constant: bool = False,
                      linear_scale: float | None = None) -> ProducedRows:
    """For x [B, H, N, w] (float32, any strides but a last of 1), the features [1 (``constant``), x_i
    ``linear_scale`` (unless None), then per i (x_i ``square_scale``) x_i and (x_i ``pair_scale``) x_j for j > i]
    as ``ops.products.ProducedRows`` [B, H, N, D]. The scales are rounded to float32, as torch rounds a Python
    scalar that multiplies a float32 tensor. No gradients."""
    b, h, n, width = x.shape
    linear = linear_scale is not None
    shape = (b, h, n, pair_feature_count(width, constant, linear))
    floats = (linear_scale if linear else 0.0, square_scale, pair_scale)
    return ProducedRows("pair_rows", shape, (x,), (width, int(constant), int(linear)), floats)


def _build_pair_rows(tensors, ints, floats) -> BuiltRows:
    (x,) = tensors
    width, constant, linear = ints
    if x.stride(-1) != 1:
        x = x.contiguous()
    return made(library(), "pair_rows", (x,), x=x.data_ptr(), heads=x.shape[1], stride_b=x.stride(0),
                stride_h=x.stride(1), stride_n=x.stride(2), width=width, constant=constant, linear=linear,
                linear_scale=floats[0], square_scale=floats[1], pair_scale=floats[2])


products.register_maker("pair_rows", _build_pair_rows)
