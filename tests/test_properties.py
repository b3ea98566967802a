"""Property tests of the attention math over random shapes, padding patterns, dtypes and maps."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luna_convert.adapters import key_padding_mask
from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import FEATURE_MAPS
from luna_convert.ops.linear import linear_attention
from luna_convert.ops.reference import EPS, linear_attention_weights

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def attention_inputs(draw, dtypes=(torch.float32,)):
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 3))
    n = draw(st.integers(1, 12))
    d = draw(st.sampled_from([2, 4, 8]))
    name = draw(st.sampled_from(sorted(FEATURE_MAPS)))
    dtype = draw(st.sampled_from(dtypes))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    # Any padding pattern (not only trailing), each row with at least one real key.
    rows = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(b)]
    mask = torch.tensor(rows, dtype=torch.bool).reshape(b, n)
    mask[torch.arange(b), draw(st.integers(0, n - 1))] = True
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (scale * torch.randn(b, h, n, d, generator=g) for _ in range(3))
    torch.manual_seed(seed)
    layer = LinearAttention(name, d, h, d**-0.5, dwc=False).eval()
    return layer, q, k, v, mask, dtype


def reference(phi_q, phi_k, v, mask, eps=EPS):
    """Float64: out_i = sum_j phi(q_i).phi(k_j) v_j / (sum_m phi(q_i).phi(k_m) + eps), real keys only.
    (eps = 0 is the textbook formula; the library adds its documented eps guard.)"""
    scores = torch.einsum("bhnf,bhmf->bhnm", phi_q.double(), phi_k.double())
    scores = scores * mask[:, None, None, :].double()
    den = scores.sum(-1, keepdim=True)
    return (scores @ v.double()) / (den + eps), den


@SETTINGS
@given(attention_inputs())
def test_matches_explicit_formula_fp32(inputs):
    layer, q, k, v, mask, _ = inputs
    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k)
        out = linear_attention(phi_q, phi_k, v, mask)
        ref, den = reference(phi_q, phi_k, v, mask)
        exact, _ = reference(phi_q, phi_k, v, mask, eps=0.0)
    assert out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())
    if layer.phi_q.signed_features:
        # Signed features (Taylor) cancel in float32's sums, so the error scales with
        # sum_j |phi(q_i)|.|phi(k_j)| |v_j| / den, not with |out|: measured at most 1.2e-7 of that (beyond 1e-5)
        # over 2,000 examples of this strategy's shapes and scales (1e-3 absolute at scale 5)
        scale = (phi_q.double().abs() @ ((phi_k.double() * mask[:, None, :, None]).abs().transpose(-1, -2)
                                         @ v.double().abs())) / den
        assert bool(((out.double() - ref).abs() <= 1e-5 + 1e-6 * scale).all())
    else:
        # measured at most 2.8e-6 over 7 x 40 examples (values up to 16)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
        # Where the denominator dwarfs eps, that is the textbook formula itself.
        big = den[..., 0] > 0.1
        # eps / den <= 1e-5 relative by construction, plus float32 error (measured at most 8.8e-5 at |out| ~ 9)
        torch.testing.assert_close(out.double()[big], exact[big], atol=1e-5, rtol=2e-5)
    w = linear_attention_weights(phi_q, phi_k, mask)
    assert bool((w[~mask[:, None, None, :].expand_as(w)] == 0).all())


@SETTINGS
@given(attention_inputs(dtypes=(torch.float32, torch.bfloat16)))
def test_never_nan_or_inf(inputs):
    layer, q, k, v, mask, dtype = inputs
    layer = layer.to(dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.no_grad():
        out = layer(q, k, v, key_mask=mask)
        weights = layer.attention_weights(q, k, mask)
    assert out.dtype == dtype and out.shape == v.shape
    assert bool(torch.isfinite(out).all())
    assert bool(torch.isfinite(weights).all())
    # Convex combination of real values: within their range (bf16 rounding allowed).
    vmax = float(v.float().abs().max())
    assert float(out.float().abs().max()) <= vmax * 1.02 + 1e-3


@SETTINGS
@given(attention_inputs())
def test_pad_keys_have_no_influence(inputs):
    layer, q, k, v, mask, _ = inputs
    g = torch.Generator().manual_seed(0)
    noise = lambda x: torch.where(mask[:, None, :, None], x, 1e3 * torch.randn(x.shape, generator=g))  # noqa: E731
    with torch.no_grad():
        out = layer(q, k, v, key_mask=mask)
        out_noisy = layer(q, noise(k), noise(v), key_mask=mask)
    torch.testing.assert_close(out, out_noisy, atol=0, rtol=0)  # zeroed pad features add exact zeros (measured 0)


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 9), st.data())
def test_key_padding_mask_round_trips_every_format(b, n, data):
    keep = torch.tensor([data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(b)]).reshape(b, n)
    keep[:, 0] = True
    expected = None if bool(keep.all()) else keep
    additive = torch.zeros(b, n).masked_fill(~keep, torch.finfo(torch.float32).min)
    for mask in (keep.long(), keep, additive[:, None, None, :], additive[:, None, None, :].expand(b, 1, n, n),
                 keep[:, None, None, :].expand(b, 1, n, n)):
        got = key_padding_mask(mask)
        assert (got is None and expected is None) or torch.equal(got, expected)
