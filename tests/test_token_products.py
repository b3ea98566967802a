"""The native products of made rows (``ops.products.produced_*``, ``token_products.c``) against their reference,
the same product in float64 by ``torch.bmm`` of the stored features: every tile shape the C code dispatches
(rows and vectors at their ends), the columns past the last full vector, the sum column, strided operands,
one and two threads; in the build for this CPU and, where the CPU runs it, in the AVX2 build that a CPU
without AVX-512 gets. Then: a build without vector code (x86-64's baseline) is not used.
"""

from __future__ import annotations

import platform

import pytest
import torch
from conftest import NATIVE_BUILDS, this_cpu_or_avx2

from luna_convert.ops import native, pair_rows, products


@pytest.fixture(params=NATIVE_BUILDS)
def library(request, monkeypatch):
    if pair_rows.library() is None:
        pytest.skip(native.status(pair_rows.SOURCE))
    return this_cpu_or_avx2(request.param, monkeypatch, products, "native_library", products.native_status,
                            products.NATIVE_SOURCE, "product_lanes")


def stored_pairs(x: torch.Tensor) -> torch.Tensor:
    """``pair_feature_rows(x, 1, 1)``'s features in float64: x_i x_j for i <= j."""
    i, j = torch.triu_indices(x.shape[-1], x.shape[-1])
    return x.double()[..., i] * x.double()[..., j]


# width: features w (w + 1) / 2 = 1, 6, 15, 66, 120 (tile rows 1-6 and their ends); columns: full vectors of 8
# or 16 lanes, ends of 1-15, fewer columns than a vector; tokens: one, a partial tile, past the 256-token block
SHAPES = [(15, 64, 512), (11, 65, 300), (5, 17, 7), (3, 16, 1), (11, 70, 513), (1, 3, 257), (2, 49, 31)]


@pytest.mark.parametrize("width, columns, tokens", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_produced_products_match_bmm(library, width, columns, tokens, threads):
    torch.manual_seed(width)
    x = torch.randn(2, tokens, 3, width + 2)[..., :width].transpose(1, 2)  # heads split, rows strided
    y = torch.randn(2, 3, tokens, columns + 3)[..., :columns]
    rows = pair_rows.pair_feature_rows(x, 1.0, 1.0)
    phi = stored_pairs(x)
    w = torch.randn(2, 3, phi.shape[-1], columns)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for with_sum in (False, True):
                out = products.produced_transposed_product(rows, y, with_sum)
                want = phi.transpose(-1, -2) @ y.double()
                if with_sum:
                    want = torch.cat([want, phi.sum(-2)[..., None]], -1)
                assert out.shape == want.shape and out.dtype == torch.float32
                torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
            out = products.produced_product(rows, w)
            torch.testing.assert_close(out.double(), phi @ w.double(), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


def test_a_build_without_vector_code_is_not_used(monkeypatch):
    """x86-64's baseline (SSE2, no FMA): ``product_lanes`` is 0, the status says why, and no map offers rows."""
    if platform.machine() not in ("x86_64", "AMD64") or native.compiler() is None:
        pytest.skip("needs an x86 CPU and a C compiler")
    baseline = native.build_variant(products.NATIVE_SOURCE, ())
    assert baseline.product_lanes() == 0
    monkeypatch.setattr(native, "load_library", lambda *a: baseline)
    assert products.native_library() is None
    assert products.native_status() == "off: no AVX2 with FMA or AVX-512 on this CPU"
    assert not products.produced_rows_apply(torch.randn(2, 3, 9, 4))
