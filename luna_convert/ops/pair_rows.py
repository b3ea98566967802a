"""Pair features made inside the core's native products (``pair_rows.c``), float32 on the CPU at inference:
[1, a x, the pairs of x x^T (the diagonal times s, the rest times p)], the form of Taylor's map and of the
self-tensored sketch of LLoPS. D grows as w^2 / 2 (Taylor's 2,145 at w = 64: stored, 33 times the memory of
its inputs, and above 32 MiB the layer streams them in chunks); made a block of tokens at a time inside the
products, they never go to memory. The same values to the bit as the maps' PyTorch forwards, the
references (tests/test_produced_rows.py). x is read from memory, or made by another maker: LLoPS's sketch
(``factor_product_rows``) from its projections (``products.affine_feature_rows``), so that not even the sketch
is stored. Where ``ops.native`` cannot build the library the maps store their features as before. The makers
are declarations (``ops.products.ProducedRows``): compiled and exported graphs hand them to the made-rows
operators, which build them from the run's tensors.
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


def pair_feature_rows(x: torch.Tensor | ProducedRows, square_scale: float, pair_scale: float, constant: bool = False,
                      linear_scale: float | None = None) -> ProducedRows:
    """For x [B, H, N, w] (float32, any strides but a last of 1; or rows another maker makes), the features [1
    (``constant``), x_i ``linear_scale`` (unless None), then per i (x_i ``square_scale``) x_i and (x_i
    ``pair_scale``) x_j for j > i] as ``ops.products.ProducedRows`` [B, H, N, D]. The scales are rounded to
    float32, as torch rounds a Python scalar that multiplies a float32 tensor. No gradients."""
    b, h, n, width = x.shape
    linear = linear_scale is not None
    shape = (b, h, n, pair_feature_count(width, constant, linear))
    ints = (width, int(constant), int(linear))
    floats = (linear_scale if linear else 0.0, square_scale, pair_scale)
    if isinstance(x, ProducedRows):
        return ProducedRows("pair_rows", shape, (None,), ints, floats, source=x)
    return ProducedRows("pair_rows", shape, (x,), ints, floats)


def _build_pair_rows(tensors, ints, floats, source: BuiltRows | None) -> BuiltRows:
    (x,) = tensors
    width, constant, linear = ints
    terms = dict(width=width, constant=constant, linear=linear, linear_scale=floats[0], square_scale=floats[1],
                 pair_scale=floats[2])
    if x is None:  # made by the source
        return made(library(), "pair_rows", (source,), x=None, heads=1, stride_b=0, stride_h=0, stride_n=0,
                    source=source.function, source_state=source.address, **terms)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return made(library(), "pair_rows", (x,), x=x.data_ptr(), heads=x.shape[1], stride_b=x.stride(0),
                stride_h=x.stride(1), stride_n=x.stride(2), source=None, source_state=None, **terms)


def factor_product_rows(z: ProducedRows, factors: int, scale: float) -> ProducedRows:
    """psi [..., w] = (z_1 z_2 ... z_factors) ``scale`` for the rows z [..., factors w] that another maker makes,
    z_f its f-th block of w columns, multiplied in factor order, then scaled (LLoPS's sketch from its
    projections), itself made a block of tokens at a time. No gradients."""
    width = z.shape[-1] // factors
    if width * factors != z.shape[-1]:
        raise ValueError(f"{z.shape[-1]} columns do not split into {factors} factors")
    return ProducedRows("factor_product_rows", (*z.shape[:-1], width), (), (factors, width), (scale,), source=z)


def _build_factor_product_rows(tensors, ints, floats, source: BuiltRows) -> BuiltRows:
    factors, width = ints
    return made(library(), "factor_product_rows", (source,), source=source.function, source_state=source.address,
                factors=factors, width=width, scale=floats[0])


products.register_maker("pair_rows", (1, 3, 3), _build_pair_rows)
products.register_maker("factor_product_rows", (0, 2, 1), _build_factor_product_rows)
