"""The linear-attention core's native products (``ops.products``, ``token_products.c``) against their
reference, the same product in float64 by ``torch.bmm``: every tile shape the C code dispatches (rows and
vectors at their ends), the columns past the last full vector, the sum column, a bias, strided rows and
batch entries, one and two threads; in the build for this CPU and, where the CPU runs it, in the AVX2
build that a CPU without AVX-512 gets. Then: the core gives the same values and gradients with and
without the native products, takes them only where they apply, and a build without vector code (x86-64's
baseline) is not used.
"""

from __future__ import annotations

import platform

import pytest
import torch
from conftest import NATIVE_BUILDS, this_cpu_or_avx2

from luna_convert.ops import linear, native, products


@pytest.fixture(params=NATIVE_BUILDS)
def library(request, monkeypatch):
    return this_cpu_or_avx2(request.param, monkeypatch, products, "native_library", products.native_status,
                            products.NATIVE_SOURCE, "product_lanes")


def reference_transposed(x, y, with_sum):
    out = torch.bmm(x.double().transpose(1, 2), y.double())
    return torch.cat([out, x.double().sum(1, keepdim=True).transpose(1, 2)], -1) if with_sum else out


def strided(shape, extra: int, seed: int) -> torch.Tensor:
    """A [B, N, C] float32 tensor whose rows lie ``extra`` floats apart beyond C (a slice of a wider one)."""
    torch.manual_seed(seed)
    return torch.randn(*shape[:-1], shape[-1] + extra)[..., :shape[-1]]


# depth: features (tile rows 1-6 and their ends); columns: full vectors of 8 or 16 lanes, ends of 1-15,
# fewer columns than a vector; tokens: one, a partial tile, past the 256-token block
SHAPES = [(64, 64, 4096 // 8), (64, 65, 300), (13, 17, 7), (6, 16, 1), (130, 70, 513), (5, 3, 257), (1, 49, 31)]


@pytest.mark.parametrize("depth, columns, tokens", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_transposed_product_matches_bmm(library, depth, columns, tokens, threads):
    x, y = strided((3, tokens, depth), 3, depth), strided((3, tokens, columns), 0, columns)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for with_sum in (False, True):
            out = products.transposed_product(x, y, with_sum)
            assert out.shape == (3, depth, columns + with_sum) and out.dtype == torch.float32
            torch.testing.assert_close(out.double(), reference_transposed(x, y, with_sum), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("depth, columns, tokens", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_product_matches_bmm(library, depth, columns, tokens, threads):
    x = strided((3, tokens, depth), 5, tokens)
    w = strided((3, depth, columns), 2, depth)
    w_t = strided((3, columns, depth), 0, columns).transpose(1, 2)  # unit row stride: copied first
    bias = torch.randn(3, 1, columns)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for weight in (w, w_t):
            reference = torch.bmm(x.double(), weight.double())
            torch.testing.assert_close(products.product(x, weight).double(), reference, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(products.product(x, weight, bias).double(), reference + bias.double(),
                                       rtol=1e-5, atol=1e-4)
        shared = torch.randn(1, 1, columns).expand(3, 1, columns)  # one bias for every batch entry
        torch.testing.assert_close(products.product(x, w, shared).double(),
                                   torch.bmm(x.double(), w.double()) + shared.double(), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_four_dim_operands_at_their_strides(library, threads):
    """[B, H, N, C] operands as the heads split from [B, N, H C] (row stride H C) and one expanded over the
    batch (stride 0), read where they lie."""
    torch.manual_seed(threads)
    b, h, n, depth, columns = 2, 3, 37, 20, 17
    x = torch.randn(b, n, h, depth).transpose(1, 2)
    y = torch.randn(b, n, h, columns).transpose(1, 2)
    w = torch.randn(1, h, depth, columns).expand(b, h, depth, columns)
    bias = torch.randn(b, h, 1, columns)
    x64, y64, w64 = x.double().reshape(-1, n, depth), y.double().reshape(-1, n, columns), w.double().reshape(-1, depth, columns)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sums = products.transposed_product(x, y, with_sum=True)
        assert sums.shape == (b, h, depth, columns + 1)
        torch.testing.assert_close(sums.double(), reference_transposed(x64, y64, True).view(b, h, depth, -1),
                                   rtol=1e-5, atol=1e-4)
        reference = (torch.bmm(x64, w64) + bias.double().reshape(-1, 1, columns)).view(b, h, n, columns)
        out = products.product(x, w, bias)
        assert out.shape == (b, h, n, columns) and out.is_contiguous()
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


def test_outputs_are_float32_whatever_the_default_dtype(library):
    """The C code writes floats: its output buffers are float32 even where torch's default dtype is float64
    (they were made at the default dtype once, and then held float32 bits read as float64)."""
    torch.manual_seed(3)
    x, y, w = torch.randn(2, 50, 8), torch.randn(2, 50, 5), torch.randn(2, 8, 5)
    want = products.transposed_product(x, y, with_sum=True), products.product(x, w)
    torch.set_default_dtype(torch.float64)
    try:
        got = products.transposed_product(x, y, with_sum=True), products.product(x, w)
    finally:
        torch.set_default_dtype(torch.float32)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_products_keep_bmm_where_the_native_code_does_not_apply(monkeypatch):
    """float64, operands that record a gradient, features with a column stride (Taylor's and LLoPS's
    [.., N, D] views of feature-major memory): torch.bmm, to the bit. Float32 operands: the native code,
    when it is built."""
    calls = []
    monkeypatch.setattr(native, "run_in_chunks", lambda *a: calls.append(a))
    torch.manual_seed(0)
    x, y, w = torch.randn(2, 9, 4), torch.randn(2, 9, 3), torch.randn(2, 4, 3)
    assert torch.equal(products.transposed_product(x.double(), y.double()),
                       torch.bmm(x.double().transpose(1, 2), y.double()))
    assert torch.equal(products.product(x.double(), w.double()), torch.bmm(x.double(), w.double()))
    four_dim = products.product(x.double()[None], w.double()[None])  # [1, 2, 9, 3]
    assert torch.equal(four_dim[0], torch.bmm(x.double(), w.double()))
    leaf = x.clone().requires_grad_()
    assert products.product(leaf, w).requires_grad
    feature_major = torch.randn(2, 4, 9).transpose(1, 2)
    assert torch.equal(products.transposed_product(feature_major, y), torch.bmm(feature_major.transpose(1, 2), y))
    # operands that do not match reach torch.bmm, which says so, never the C code, which would read past them
    for mismatched in (lambda: products.product(x, w[:1]), lambda: products.product(x, w[:, :3]),
                       lambda: products.transposed_product(x, y[:, :8]),
                       lambda: products.product(x, w, bias=torch.zeros(2, 2, 3))):
        with pytest.raises(RuntimeError):
            mismatched()
    assert calls == []
    products.transposed_product(x, y)
    products.product(x, w)
    assert len(calls) == (2 if products.native_library() is not None else 0)


@pytest.mark.parametrize("masked, clamp", [(False, False), (True, False), (False, True)])
def test_core_gives_the_same_values_and_gradients_with_the_native_products(library, monkeypatch, masked, clamp):
    """``linear_attention`` (the core's forward and hand-written backward) and ``linear_attention_unnormalised``
    with the native products against the same calls on torch.bmm."""
    torch.manual_seed(1)
    b, h, n, features, d = 2, 3, 37, 20, 16
    phi_q, phi_k = torch.rand(b, h, n, features) + 0.1, torch.rand(b, h, n, features) + 0.1
    v, grad = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    key_mask = torch.rand(b, n) > 0.3 if masked else None

    def run():
        inputs = [t.clone().requires_grad_() for t in (phi_q, phi_k, v)]
        out = linear.linear_attention(*inputs, key_mask, clamp=clamp)
        out.backward(grad)
        return [out.detach(), linear.linear_attention_unnormalised(phi_q, phi_k, v, key_mask),
                *(t.grad for t in inputs)]

    calls = []
    counted = native.run_in_chunks
    monkeypatch.setattr(native, "run_in_chunks", lambda *a: (calls.append(a), counted(*a)))
    with_native = run()
    assert len(calls) == 2 + 4 + 2  # forward, backward (four products), unnormalised
    monkeypatch.setattr(products, "native_library", lambda: None)
    with_bmm = run()
    for got, expected in zip(with_native, with_bmm):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_build_without_vector_code_is_not_used(monkeypatch):
    """x86-64's baseline (SSE2, no FMA): ``product_lanes`` is 0, the status says why, torch.bmm runs."""
    if platform.machine() not in ("x86_64", "AMD64") or native.compiler() is None:
        pytest.skip("needs an x86 CPU and a C compiler")
    baseline = native.build_variant(products.NATIVE_SOURCE, ())
    assert baseline.product_lanes() == 0
    monkeypatch.setattr(native, "load_library", lambda *a: baseline)
    assert products.native_library() is None
    assert products.native_status() == "off: no AVX2 with FMA or AVX-512 on this CPU"
    calls = []
    monkeypatch.setattr(native, "run_in_chunks", lambda *a: calls.append(a))
    x, y = torch.randn(2, 9, 4), torch.randn(2, 9, 3)
    assert torch.equal(products.transposed_product(x, y), torch.bmm(x.transpose(1, 2), y)) and calls == []
