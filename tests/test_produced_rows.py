"""Features made inside the core's native products and never stored (``ops.products.ProducedRows``,
``ops.linear.produced_attention_unnormalised``; LUNA's ``luna_rows`` in luna_channels.c, Taylor's and
LLoPS's ``ops/pair_rows.c``): the two products of produced rows against ``torch.bmm`` in float64 of the stored
features, and to the bit against the native products of the stored features; a layer's output unchanged to
the bit with and without them (LUNA's paper form and conversion defaults, Taylor with and without its
projection; key masks, DWC on and off, one and two threads), in the build for this CPU and in the AVX2
build; long inputs not streamed; and the rows offered only where they apply (no gradients, float32, no
autocast).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import NATIVE_BUILDS, this_cpu_or_avx2

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import luna_native
from luna_convert.ops import exp_rows, native, pair_rows, products
from luna_convert.ops.context import AttentionContext

PAPER = dict(projections=8, channels=8, per_head_projections=False, projection_init="random",
             channel_init="random", feature_norm="none", separate_key_map=False)
# The makers that repeat the stored forward's float operations (the same features to the bit); T2R's and LLoPS's
# sum their projections in the products' tile order, not MKL's, and ELU's exp is the project's own; Performer's
# and Flexformer's logits too, and their queries' leave out a term that their max takes out again.
SAME_FEATURES = {"luna", "taylor", "hedgehog", "relu", "cosformer"}
FORMS = {"paper": ("luna", PAPER), "defaults": ("luna", {}), "taylor": ("taylor", {}),
         "taylor, projected": ("taylor", {"project_dim": 5}), "llops": ("llops", {"rank": 6}),
         "llops, homogeneous": ("llops", {"rank": 5, "homogeneous": True, "qk_norm": True}),
         "llops, degree 6": ("llops", {"rank": 7, "degree": 6}),
         "t2r": ("t2r", {}), "t2r, 20 features": ("t2r", {"feature_dim": 20}), "hedgehog": ("hedgehog", {}),
         "relu": ("relu", {}), "elu": ("elu", {}), "cosformer": ("cosformer", {}),
         "performer": ("performer", {}), "performer, 20 features": ("performer", {"num_features": 20}),
         "flexformer": ("flexformer", {})}
# At these sizes their keys' features are given stored (below performer.MADE_KEYS_MIN_BYTES), their queries' made.
STORED_KEYS = {"performer", "flexformer"}


@pytest.fixture(params=NATIVE_BUILDS)
def library(request, monkeypatch):
    for maps in (luna_native, pair_rows, exp_rows):
        if maps.library() is None:
            pytest.skip(native.status(maps.SOURCE))
    return this_cpu_or_avx2(request.param, monkeypatch, products, "native_library", products.native_status,
                            products.NATIVE_SOURCE, "product_lanes")


def layer_of(form: str, head_dim: int = 16, heads: int = 3, **overrides) -> LinearAttention:
    method, options = FORMS[form]
    torch.manual_seed(0)
    layer = LinearAttention(method, head_dim, heads, head_dim**-0.5, **options, **overrides).eval()
    if method == "hedgehog":  # W = I and b = 0 at conversion: a head mixed up with another would not show
        with torch.no_grad():
            for parameter in layer.method_parameters():
                parameter.normal_(0.0, 0.3)
    return layer


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
    layer, method = layer_of(form), FORMS[form][0]
    q, k = heads_split(2, 3, tokens, 16, 1), heads_split(2, 3, tokens, 16, 2)
    torch.manual_seed(3)
    y = torch.randn(2, 3, tokens, columns)
    with torch.no_grad():
        q_rows, k_rows = layer.feature_rows(q, k)
        phi_q, phi_k = layer.features(q, k)
        width = phi_q.shape[-1]
        w = torch.randn(2, 3, width, columns)
        assert q_rows.shape == k_rows.shape == phi_q.shape
        if method in STORED_KEYS:
            assert torch.equal(k_rows, phi_k)
        for with_sum in (False, True) if method not in STORED_KEYS else ():
            made = with_threads(threads, lambda: products.produced_transposed_product(k_rows, y, with_sum))
            reference = phi_k.double().transpose(-1, -2) @ y.double()
            magnitude = phi_k.double().abs().transpose(-1, -2) @ y.double().abs()
            if with_sum:
                reference = torch.cat([reference, phi_k.double().sum(-2)[..., None]], -1)
                magnitude = torch.cat([magnitude, phi_k.double().abs().sum(-2)[..., None]], -1)
            assert_within_rounding(made, reference, magnitude)
            if method in SAME_FEATURES:  # Taylor's lie feature-major: the native products want them contiguous
                assert torch.equal(made, products.transposed_product(phi_k.contiguous(), y, with_sum))
        made = with_threads(threads, lambda: products.produced_product(q_rows, w))
        assert_within_rounding(made, phi_q.double() @ w.double(), phi_q.double().abs() @ w.double().abs())
        if method in SAME_FEATURES:
            assert torch.equal(made, products.product(phi_q.contiguous(), w))


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
        monkeypatch.setattr(layer, "feature_rows", lambda *args: None)
        stored = with_threads(threads, lambda: layer(q, k, v, key_mask=mask))
    assert len(made) == 1
    if FORMS[form][0] in ("luna", "hedgehog", "relu", "cosformer"):  # the same features, the native products both ways
        assert torch.equal(out, stored)
    else:
        # Taylor's stored features take torch.bmm (feature-major), which sums in another order, the others'
        # features round otherwise, and signed features cancel in the sums: both as far from the float64 layer
        # on average, within a factor (the largest error alone varies more: LLoPS's degree 6)
        with torch.no_grad():
            reference = copy.deepcopy(layer).double()(q.double(), k.double(), v.double(), key_mask=mask)
        made_error, stored_error = ((t.double() - reference).abs().mean().item() for t in (out, stored))
        assert made_error <= 2 * stored_error + 1e-8, (made_error, stored_error)


@pytest.mark.parametrize("form", ["defaults", "taylor", "llops", "relu", "elu", "cosformer"])
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
        monkeypatch.setattr(layer, "feature_rows", lambda *args: None)
        torch.testing.assert_close(out, layer(q, k, v), rtol=0, atol=1e-6)
        assert streamed


def test_rows_are_offered_only_where_they_apply(library):
    q = heads_split(1, 3, 20, 16, 1)
    for form in FORMS:
        layer = layer_of(form)  # LLoPS's maps have parameters, Taylor's without its projection none
        with torch.no_grad():
            assert layer.feature_rows(q, q) is not None
            assert layer.feature_rows(q.double(), q.double()) is None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert layer.feature_rows(q, q) is None
        assert layer.feature_rows(q.clone().requires_grad_(), q) is None  # a gradient is recorded for q
        if list(layer.parameters()):
            assert layer.feature_rows(q, q) is None  # and for the map's parameters
        else:  # Taylor's map without its projection has none, nor have the fixed maps
            assert layer.feature_rows(q, q) is not None
    with torch.no_grad():
        assert layer_of("paper", envelope=True).feature_rows(q, q) is None  # a gate the native pass lacks
        signed = LinearAttention("flexformer", 16, 3, 0.25, variant="stationary").eval()
        assert signed.feature_rows(q, q) is None  # a map that offers no rows
        assert layer_of("performer", kernel_epsilon=1e-4).feature_rows(q, q) is None  # a floor the maker lacks


def test_produced_products_check_their_operands(library):
    layer = layer_of("paper")
    q = heads_split(1, 3, 20, 16, 1)
    with torch.no_grad():
        rows, _ = layer.feature_rows(q, q)
    with pytest.raises(ValueError, match="tokens"):
        products.produced_transposed_product(rows, torch.randn(1, 3, 21, 16))
    with pytest.raises(ValueError, match="float32"):
        products.produced_transposed_product(rows, torch.randn(1, 3, 20, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        products.produced_product(rows, torch.randn(1, 3, 7, 16))


@pytest.mark.parametrize("method", ["relu", "elu", "cosformer"])
@pytest.mark.parametrize("head_dim", [7, 16, 20, 33])  # a partial vector only; whole vectors (16, or 2 x 8); both
@pytest.mark.parametrize("masked", [False, True])
def test_pointwise_rows_are_the_maps_features(exp_rows_library, method, head_dim, masked):
    """``exp_rows.pointwise_feature_rows`` (ReLU's, ELU's and cosFormer's makers), read back through a product
    with the identity (exact for finite features: each sum adds zeros to one product by 1), against the map's
    forward: the same to the bit, ELU's to its exp's rounding; a NaN input keeps its token's features NaN."""
    if products.native_library() is None:
        pytest.skip(products.native_status())
    layer = LinearAttention(method, head_dim, 3, head_dim**-0.5).eval()
    q = heads_split(2, 3, 300, head_dim, 1)
    q[0, 1, 5, head_dim // 2] = float("nan")
    mask = torch.rand(2, 300, generator=torch.Generator().manual_seed(4)) > 0.3 if masked else None
    context = AttentionContext(mask, 300)
    with torch.no_grad():
        (rows,) = layer.phi_q.feature_rows(q, context=context)
        stored = layer.phi_q(q, context)
        width = stored.shape[-1]
        made = products.produced_product(rows, torch.eye(width).expand(2, 3, width, width))
    nan_rows = stored.isnan().any(-1)
    assert nan_rows.sum() == 1 and made.isnan().all(-1).equal(nan_rows)
    made, stored = made[~nan_rows], stored[~nan_rows]
    if method == "elu":
        torch.testing.assert_close(made, stored, rtol=5e-7, atol=0)
    else:
        assert torch.equal(made, stored)


def test_cosformer_rows_leave_prefix_tokens_to_the_stored_path(library):
    """Position-neutral prefix tokens (ViT's CLS) take blocks of their own: no rows; without the option, one
    raster index over all tokens, and rows again, with the same output to the bit."""
    q, k, v = (heads_split(1, 3, 17, 16, seed) for seed in (1, 2, 3))
    with torch.no_grad():
        neutral = LinearAttention("cosformer", 16, 3, 0.25).eval()
        assert neutral(q, k, v, num_prefix=1).shape == v.shape
        assert neutral.feature_rows(q, k, AttentionContext(None, 17, num_prefix=1)) is None
        raster = LinearAttention("cosformer", 16, 3, 0.25, prefix_neutral=False).eval()
        context = AttentionContext(None, 17, num_prefix=1)
        assert raster.feature_rows(q, k, context) is not None
        out = raster(q, k, v, num_prefix=1)
        raster.feature_rows = lambda *args: None
        assert torch.equal(out, raster(q, k, v, num_prefix=1))


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


@pytest.mark.parametrize("factors", [1, 2, 3])
@pytest.mark.parametrize("width", [5, 16])
def test_factor_product_rows_multiply_in_factor_order(library, factors, width):
    """``pair_rows.factor_product_rows`` (LLoPS's sketch from its projections) against torch's prod and scale, to
    the bit: its source made exactly (an affine map by the identity, no bias), read back through a product
    with the identity (exact, as above)."""
    torch.manual_seed(0)
    z = torch.randn(2, 3, 300, factors * width)
    identity = torch.eye(factors * width)
    with torch.no_grad():
        source = products.affine_feature_rows(z, identity, torch.zeros(factors * width), relu=False)
        psi = pair_rows.factor_product_rows(source, factors, width**-0.5)
        made = products.produced_product(psi, torch.eye(width).expand(2, 3, width, width))
    assert torch.equal(made, z.view(2, 3, 300, factors, width).prod(dim=-2) * width**-0.5)
    with pytest.raises(ValueError, match="factors"):
        pair_rows.factor_product_rows(source, factors * width + 1, 1.0)


@pytest.mark.parametrize("width", [5, 16, 266])  # a partial vector, one whole one, Performer's m
def test_exp_minus_max_rows_are_the_stored_exps(exp_rows_library, width):
    """``exp_rows.exp_minus_row_max_rows`` (Performer's and Flexformer's query features from their logits) to the bit
    as ``exp_rows.exp_minus_row_max_`` of the stored logits: the source made exactly and read back exactly, as
    above."""
    if products.native_library() is None:
        pytest.skip(products.native_status())
    torch.manual_seed(0)
    z = 4 * torch.randn(2, 3, 300, width)
    with torch.no_grad():
        source = products.affine_feature_rows(z, torch.eye(width), torch.zeros(width), relu=False)
        features = exp_rows.exp_minus_row_max_rows(source, 0.75)
        made = products.produced_product(features, torch.eye(width).expand(2, 3, width, width))
    assert torch.equal(made, exp_rows.exp_minus_row_max_(z.clone(), 0.75))


@pytest.mark.parametrize("vectors", [1, 2])
def test_softmax_pair_rows_are_the_softmax_pair_of_the_logits(exp_rows_library, vectors):
    """``exp_rows.softmax_pair_rows`` (Hedgehog's features from its logits) to the bit as ``exp_rows.softmax_pair``
    of the stored logits, and within float32 rounding of ``softmax_pair_reference``: the source made exactly and
    read back exactly, as above."""
    if products.native_library() is None:
        pytest.skip(products.native_status())
    width = vectors * exp_rows.lanes()
    torch.manual_seed(0)
    z = 3 * torch.randn(2, 3, 300, width)
    with torch.no_grad():
        source = products.affine_feature_rows(z, torch.eye(width), torch.zeros(width), relu=False)
        features = exp_rows.softmax_pair_rows(source)
        made = products.produced_product(features, torch.eye(2 * width).expand(2, 3, 2 * width, 2 * width))
    assert torch.equal(made, exp_rows.softmax_pair(z))
    torch.testing.assert_close(made.double(), exp_rows.softmax_pair_reference(z.double()), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["performer", "flexformer"])
def test_positive_key_rows_are_the_stored_key_features(library, monkeypatch, method):
    """Performer's and Flexformer's key features made in the products (``exp_rows.positive_key_rows``: the
    stabiliser over real keys from a pass of its own), read back through a product with the identity, against
    the stored key features: to float32 rounding of the logits' arguments, pad keys exactly 0, an example
    without a real key all 0. Then a layer with its keys made: no further from the float64 layer than the
    stored path, on average within 2x."""
    from luna_convert.linear_methods import performer

    monkeypatch.setattr(performer, "MADE_KEYS_MIN_BYTES", 0)  # made at any size
    layer = layer_of(method)
    k = heads_split(3, 3, 300, 16, 2)
    mask = torch.rand(3, 300, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[2] = False
    context = AttentionContext(mask, 300, role="key")
    with torch.no_grad():
        (rows,) = layer.phi_q.feature_rows(k, context=context)
        stored = layer.phi_q(k, context)
        width = stored.shape[-1]
        made = products.produced_product(rows, torch.eye(width).expand(3, 3, width, width))
    pads = ~mask[:, None, :, None].expand_as(made)
    assert (made[pads] == 0).all() and (stored[pads] == 0).all()
    assert made.amax() == pytest.approx(width**-0.5, rel=1e-5)  # the largest real key's largest feature is m^-1/2
    torch.testing.assert_close(made, stored, rtol=5e-5, atol=1e-12)
    q, v = heads_split(3, 3, 300, 16, 1), heads_split(3, 3, 300, 16, 3)
    mask[2, :2] = True  # an example with two real keys: a division by a small sum
    with torch.no_grad():
        out = layer(q, k, v, key_mask=mask)
        layer.feature_rows = lambda *args: None
        stored_out = layer(q, k, v, key_mask=mask)
        reference = copy.deepcopy(layer).double()(q.double(), k.double(), v.double(), key_mask=mask)
    made_error, stored_error = ((t.double() - reference).abs().mean().item() for t in (out, stored_out))
    assert made_error <= 2 * stored_error + 1e-8, (made_error, stored_error)
