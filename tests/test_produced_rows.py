"""Taylor's features made inside the core's native products and never stored (``ops.products.ProducedRows``,
``ops.linear.produced_attention_unnormalised``, ``ops/pair_rows.c``): the two products of produced rows against
``torch.bmm`` in float64 of the stored features; a layer's output as close to the float64 layer as the stored
path's (with and without its projection; key masks, DWC on and off, one and two threads), in the build for
this CPU and in the AVX2 build; long inputs not streamed; and the rows offered only where they apply (no
gradients, float32, no autocast).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import NATIVE_BUILDS, this_cpu_or_avx2

from luna_convert.layers.attention import LinearAttention
from luna_convert.ops import native, pair_rows, products

FORMS = {"taylor": ("taylor", {}), "taylor, projected": ("taylor", {"project_dim": 5})}


@pytest.fixture(params=NATIVE_BUILDS)
def library(request, monkeypatch):
    if pair_rows.library() is None:
        pytest.skip(native.status(pair_rows.SOURCE))
    return this_cpu_or_avx2(request.param, monkeypatch, products, "native_library", products.native_status,
                            products.NATIVE_SOURCE, "product_lanes")


def layer_of(form: str, head_dim: int = 16, heads: int = 3, **overrides) -> LinearAttention:
    method, options = FORMS[form]
    torch.manual_seed(0)
    return LinearAttention(method, head_dim, heads, head_dim**-0.5, **options, **overrides).eval()


def heads_split(batch: int, heads: int, tokens: int, head_dim: int, seed: int) -> torch.Tensor:
    """[B, H, N, d] as the adapters pass it: a view of the heads split from [B, N, H d]."""
    torch.manual_seed(seed)
    return torch.randn(batch, tokens, heads, head_dim).transpose(1, 2)


def with_threads(threads: int, fn):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def assert_within_rounding(made: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Sums of float32 products within 1e-5 of the sum of their terms' magnitudes (a sum's rounding bound, with
    room for features that round differently: LLoPS's degree-6 products amplify their projections' rounding)."""
    error = (made.double() - reference).abs()
    assert (error <= 1e-5 * magnitude + 1e-6).all(), (error - 1e-5 * magnitude).max().item()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tokens", [1, 7, 300, 513])  # one token, a partial tile, past the 256-token block
@pytest.mark.parametrize("columns", [16, 17, 65])  # full vectors, and columns past them
@pytest.mark.parametrize("threads", [1, 2])
def test_products_of_produced_rows_match_the_stored_features(library, form, tokens, columns, threads):
    layer = layer_of(form)
    q, k = heads_split(2, 3, tokens, 16, 1), heads_split(2, 3, tokens, 16, 2)
    torch.manual_seed(3)
    y = torch.randn(2, 3, tokens, columns)
    with torch.no_grad():
        q_rows, k_rows = layer.feature_rows(q, k)
        phi_q, phi_k = layer.features(q, k)
        width = phi_q.shape[-1]
        w = torch.randn(2, 3, width, columns)
        assert q_rows.shape == k_rows.shape == phi_q.shape
        for with_sum in (False, True):
            made = with_threads(threads, lambda: products.produced_transposed_product(k_rows, y, with_sum))
            reference = phi_k.double().transpose(-1, -2) @ y.double()
            magnitude = phi_k.double().abs().transpose(-1, -2) @ y.double().abs()
            if with_sum:
                reference = torch.cat([reference, phi_k.double().sum(-2)[..., None]], -1)
                magnitude = torch.cat([magnitude, phi_k.double().abs().sum(-2)[..., None]], -1)
            assert_within_rounding(made, reference, magnitude)
        made = with_threads(threads, lambda: products.produced_product(q_rows, w))
        assert_within_rounding(made, phi_q.double() @ w.double(), phi_q.double().abs() @ w.double().abs())

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dwc", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_output_is_the_same_to_the_bit(library, monkeypatch, form, masked, dwc, threads):
    layer = layer_of(form, dwc=dwc)
    tokens = 300
    q, k, v = (heads_split(2, 3, tokens, 16, seed) for seed in (1, 2, 3))
    mask = None
    if masked:
        mask = torch.rand(2, tokens, generator=torch.Generator().manual_seed(4)) > 0.3
        mask[1] = False  # an example without a real key
        mask[1, :2] = True
    made = []
    real = products.produced_product
    monkeypatch.setattr(products, "produced_product", lambda *a: (made.append(1), real(*a))[1])
    with torch.no_grad():
        out = with_threads(threads, lambda: layer(q, k, v, key_mask=mask))
        assert made, "the produced rows were not used"
        monkeypatch.setattr(layer.phi_q, "makes_rows", lambda x: False)  # the layer takes the stored path
        stored = with_threads(threads, lambda: layer(q, k, v, key_mask=mask))
    assert len(made) == 1
    # The stored features take torch.bmm, which sums in another order: both as far from the float64 layer on
    # average, within a factor
    with torch.no_grad():
        reference = copy.deepcopy(layer).double()(q.double(), k.double(), v.double(), key_mask=mask)
    made_error, stored_error = ((t.double() - reference).abs().mean().item() for t in (out, stored))
    assert made_error <= 2 * stored_error + 1e-8, (made_error, stored_error)

@pytest.mark.parametrize("form", FORMS)
def test_long_inputs_take_the_produced_rows_instead_of_streaming(library, monkeypatch, form):
    import luna_convert.layers.attention as attention

    layer = layer_of(form)
    layer.stream_min_bytes, layer.stream_chunk_bytes = 1000, 1  # the stored features would stream
    q, k, v = (heads_split(1, 3, 40, 16, seed) for seed in (1, 2, 3))
    streamed = []
    real = attention.streamed_linear_attention
    monkeypatch.setattr(attention, "streamed_linear_attention", lambda *a, **kw: (streamed.append(1), real(*a, **kw))[1])
    with torch.no_grad():
        out = layer(q, k, v)
        assert not streamed
        monkeypatch.setattr(layer.phi_q, "makes_rows", lambda x: False)  # the layer takes the stored path
        torch.testing.assert_close(out, layer(q, k, v), rtol=0, atol=1e-6)
        assert streamed


def test_rows_are_offered_only_where_they_apply(library):
    q = heads_split(1, 3, 20, 16, 1)
    for form in FORMS:
        layer = layer_of(form)
        with torch.no_grad():
            assert layer.feature_rows(q, q) is not None
            assert layer.feature_rows(q.double(), q.double()) is None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert layer.feature_rows(q, q) is None
        assert layer.feature_rows(q.clone().requires_grad_(), q) is None  # a gradient is recorded for q
        if list(layer.parameters()):
            assert layer.feature_rows(q, q) is None  # and for the map's projection
        else:  # the map without its projection has no parameters
            assert layer.feature_rows(q, q) is not None
    with torch.no_grad():
        assert LinearAttention("hedgehog", 16, 3, 0.25).eval().feature_rows(q, q) is None  # a map that offers none


def test_produced_products_check_their_operands(library):
    layer = layer_of("taylor")
    q = heads_split(1, 3, 20, 16, 1)
    with torch.no_grad():
        rows, _ = layer.feature_rows(q, q)
    with pytest.raises(ValueError, match="tokens"):
        products.produced_transposed_product(rows, torch.randn(1, 3, 21, 16))
    with pytest.raises(ValueError, match="float32"):
        products.produced_transposed_product(rows, torch.randn(1, 3, 20, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        products.produced_product(rows, torch.randn(1, 3, 7, 16))


@pytest.mark.parametrize("constant, linear", [(False, False), (True, True)])
@pytest.mark.parametrize("width", [5, 16])
def test_pair_feature_rows_are_the_pair_formula(library, constant, linear, width):
    """``pair_rows.pair_feature_rows`` (Taylor's and LLoPS's pair features) against their formula in PyTorch, read
    back through a product with the identity (exact, as above): [1, x_i l, then per i (x_i s) x_i and (x_i p) x_j
    for j > i], the scales as float32."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 300, width)
    square, pair, line = 0.3, 0.7, 0.45
    i, j = torch.triu_indices(width, width)
    scale = torch.where(i == j, torch.tensor(square), torch.tensor(pair))
    want = (x[..., i] * scale) * x[..., j]
    want = torch.cat([*([torch.ones(2, 3, 300, 1)] if constant else []), *([x * line] if linear else []), want], -1)
    with torch.no_grad():
        rows = pair_rows.pair_feature_rows(x, square, pair, constant=constant, linear_scale=line if linear else None)
        made = products.produced_product(rows, torch.eye(want.shape[-1]).expand(2, 3, *want.shape[-1:] * 2))
    torch.testing.assert_close(made, want, rtol=1e-6, atol=0)
