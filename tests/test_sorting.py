"""The additive sorting kernel (kernel kind, no finite features): its O(N log N) sorted sums against
the explicit N x N kernel written out here, gradients, padding, stability and half precision."""

from __future__ import annotations

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods.sorting import PROFILES



def explicit_kernel_attention(layer, q, k, v, mask):
    """out_i = sum_j m_j k_ij v_j / (sum_j m_j k_ij + eps), k_ij = c0 + sum_r w_r kappa((a_r.q_i - a_r.k_j)/h_r),
    in float64 with loops over batch, head, projection (independent of the library's sorted sums)."""
    kern = layer.kernel
    w, h, c0 = (t.detach() for t in kern.kernel_parameters(torch.float64))
    b, heads, n, _ = q.shape
    out = torch.zeros(b, heads, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        real = mask[bi].nonzero().flatten()
        for hi in range(heads):
            kij = torch.full((n, len(real)), float(c0[hi]), dtype=torch.float64)
            for r in range(kern.options.projections):
                a = kern.proj[hi, :, r].double()
                t = ((q[bi, hi].double() @ a)[:, None] - (k[bi, hi, real].double() @ a)[None, :]) / h[hi, r]
                profile = torch.exp(-t.abs()) if kern.options.profile == "laplace" else (1 + t.abs()) * torch.exp(-t.abs())
                kij = kij + w[hi, r] * profile
            out[bi, hi] = (kij @ v[bi, hi, real].double()) / (kij.sum(-1, keepdim=True) + kern.options.eps)
    return out


def make_layer(seed=0, **options):
    torch.manual_seed(seed)
    layer = LinearAttention("sorting", 5, 2, 5**-0.5, **{"projections": 3, **options}).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # spread weights and bandwidths so each projection matters differently
        layer.kernel.raw_weight.normal_(generator=g)
        layer.kernel.raw_bandwidth.normal_(generator=g)
        layer.kernel.raw_background.normal_(generator=g)
    return layer


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("block", [4, 32])  # 4: several levels of the block carry at N = 37
def test_sorted_sums_equal_the_explicit_kernel(profile, block):
    layer = make_layer(profile=profile)
    layer.kernel.block = block
    g = torch.Generator().manual_seed(2)
    q, k, v = (2 * torch.randn(2, 2, 37, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, 23:] = False
    mask[1, 3] = False  # a pad in the middle too
    with torch.no_grad():
        got = layer(q, k, v, mask)
        weights = layer.attention_weights(q, k, mask)
    want = explicit_kernel_attention(layer, q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # measured 7.8e-16
    torch.testing.assert_close(weights @ v, want, rtol=0, atol=1e-12)  # measured 7.8e-16
    assert torch.all(weights[1, :, :, 23:] == 0) and torch.all(weights[1, :, :, 3] == 0)


@pytest.mark.parametrize("profile", PROFILES)
def test_gradcheck_float64(profile):
    layer = make_layer(profile=profile)
    layer.kernel.block = 3
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 8, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True] * 6 + [False] * 2])
    params = [layer.kernel.proj, layer.kernel.raw_weight, layer.kernel.raw_bandwidth, layer.kernel.raw_background]
    fn = lambda q_, k_, v_, *p: layer(q_, k_, v_, mask)  # noqa: E731  (params enter through the module)
    assert torch.autograd.gradcheck(fn, (q, k, v, *params), eps=1e-6, atol=1e-7)
    # the parameters' gradients equal those of the explicit N x N form
    out = layer(q, k, v, mask)
    ref = layer.attention_weights(q, k, mask) @ v
    g_fast = torch.autograd.grad(out.square().sum(), params)
    g_ref = torch.autograd.grad(ref.square().sum(), params)
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)  # measured 1.6e-15


@pytest.mark.parametrize("profile", PROFILES)
def test_pads_change_nothing(profile):
    layer = make_layer(profile=profile).float()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 5, generator=g) for _ in range(3))
    pad = lambda x: torch.cat([x, 50 * torch.randn(1, 2, 7, 5, generator=g)], 2)  # noqa: E731
    mask = torch.tensor([[True] * 6 + [False] * 7])
    with torch.no_grad():
        alone = layer(q, k, v)
        padded = layer(pad(q), pad(k), pad(v), mask)
    torch.testing.assert_close(padded[:, :, :6], alone, rtol=0, atol=1e-6)  # measured 6.0e-8


@pytest.mark.parametrize("profile", PROFILES)
def test_huge_projections_stay_finite(profile):
    """Projections of 1e4 (exp(1e4) overflows any float): every exponent of the sums is <= 0."""
    layer = make_layer(profile=profile).float()
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 40, 5, generator=g) for _ in range(3))
    q, k = (1e4 * t for t in (q, k))
    q.requires_grad_(True)
    out = layer(q, k, v, torch.tensor([[True] * 30 + [False] * 10]))
    out.sum().backward()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(q.grad).all())
    assert float(out.detach().abs().max()) <= float(v.abs().max()) * (1 + 1e-5)  # still a convex combination of values


def test_bf16_and_autocast_are_finite_and_close():
    torch.manual_seed(0)
    layer = LinearAttention("sorting", 8, 2, 8**-0.5)
    g = torch.Generator().manual_seed(7)
    q, k, v = (4 * torch.randn(2, 2, 9, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 9, [True] * 3 + [False] * 6])
    with torch.no_grad():
        full = layer(q, k, v, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = layer(q, k, v, mask)
        half = layer(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert half.dtype == torch.bfloat16 and bool(torch.isfinite(half).all()) and bool(torch.isfinite(auto).all())
    torch.testing.assert_close(auto.float(), full, rtol=0, atol=1e-6)  # measured 0: computed in fp32 anyway
    torch.testing.assert_close(half.float(), full, rtol=0, atol=0.1)  # measured 0.051 (bf16 inputs, values up to 6.7)
