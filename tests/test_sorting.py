"""The additive sorting kernel (kernel kind, no finite features): its O(N log N) sorted sums against
the explicit N x N kernel written out here, gradients, padding, stability and half precision."""

from __future__ import annotations

import copy

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import sorting_native
from luna_convert.linear_methods.sorting import PROFILES
from luna_convert.ops import native

NATIVE = sorting_native.library() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason=f"no native kernel here: {native.unavailable_reason(sorting_native.SOURCE)}")



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


def native_calls(monkeypatch) -> list:
    """Records each call of the native pass (so a test knows which path ran)."""
    calls, run = [], sorting_native.sorting_kernel_attention
    monkeypatch.setattr(sorting_native, "sorting_kernel_attention", lambda *a: calls.append(1) or run(*a))
    return calls


def tied_inputs(seed, batch=3, heads=2, n=37, d=5):
    """float32 q, k, v with equal keys, a query equal to a key, v a strided view, and pads in the middle."""
    g = torch.Generator().manual_seed(seed)
    q, k = (2 * torch.randn(batch, heads, n, d, generator=g) for _ in range(2))
    v = 2 * torch.randn(batch, n, heads, d, generator=g).transpose(1, 2)  # the adapters' [B, N, H, d] view
    k[:, :, 6] = k[:, :, 5]  # tied keys: the scans' gap 0
    q[:, :, 3] = k[:, :, 7]  # a query on a key: that key is on its left (keys <= x)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[1, 23:] = False
    mask[-1, ::3] = False
    return q, k, v, mask


@needs_native
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_pass_equals_the_explicit_kernel(profile, threads, monkeypatch):
    layer = make_layer(profile=profile).float()
    q, k, v, mask = tied_inputs(8)
    calls, before = native_calls(monkeypatch), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = layer(q, k, v, mask)
            unmasked = layer(q, k, v)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2 and got.dtype == torch.float32
    want = explicit_kernel_attention(layer, q, k, v, mask)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)  # measured 3.9e-7 (float32 sums)
    want = explicit_kernel_attention(layer, q, k, v, torch.ones(3, 37, dtype=torch.bool))
    torch.testing.assert_close(unmasked.double(), want, rtol=0, atol=2e-6)


def sixteen_value_case(profile, seed, n):
    """A layer of 3 heads x 16 and its inputs (B = 2): 17 channels with the mask's, a vector block and a tail."""
    torch.manual_seed(0)
    return LinearAttention("sorting", 16, 3, 0.25, profile=profile), tied_inputs(seed, batch=2, heads=3, n=n, d=16)


@needs_native
@pytest.mark.parametrize("profile", PROFILES)
def test_native_pass_equals_the_pytorch_path(profile, monkeypatch):
    """At a length with several levels of the PyTorch path's block carry, and one key only."""
    layer, (q, k, v, mask) = sixteen_value_case(profile, 9, 1100)
    calls = native_calls(monkeypatch)
    with torch.no_grad():
        fast, single = layer(q, k, v, mask), layer(q[:, :, :1], k[:, :, :1], v[:, :, :1])
        monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
        slow, single_slow = layer(q, k, v, mask), layer(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    assert len(calls) == 2
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)  # measured 1.1e-6
    torch.testing.assert_close(single, single_slow, rtol=0, atol=1e-5)  # measured 9.5e-7


@needs_native
@pytest.mark.parametrize("profile", PROFILES)
def test_native_gradients_equal_the_pytorch_path(profile, monkeypatch):
    """17 channels (16 values and the mask's): the backward's dot products run one vector block and a tail."""
    layer, (q, k, v, mask) = sixteen_value_case(profile, 12, 300)
    q[:, :, 3] += 0.1  # no query on a key (laplace's kink)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(13))
    calls = native_calls(monkeypatch)

    def gradients():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(layer(*inputs, mask), inputs + list(layer.parameters()), grad_out)

    fast = gradients()
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    slow = gradients()
    assert len(calls) == 1
    for a, b in zip(fast, slow):
        # measured up to 3.5e-6 of the largest gradient (both float32)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * float(b.abs().max()))


@needs_native
@pytest.mark.parametrize("profile", PROFILES)
def test_native_gradients_equal_the_explicit_kernel(profile, monkeypatch):
    """The native backward against autograd through the explicit N x N weights in float64: q, k, v and every
    parameter. (No query on a key here: laplace's kappa has a kink at 0, where the native pass takes the
    left key's slope and autograd's abs takes 0.)"""
    reference = make_layer(profile=profile)
    layer = copy.deepcopy(reference).float()
    q, k, v, mask = tied_inputs(10)
    q[:, :, 3] += 0.1
    g = torch.Generator().manual_seed(11)
    grad_out = torch.randn(q.shape, generator=g, dtype=torch.float64)
    calls = native_calls(monkeypatch)

    def gradients(module, dtype, explicit):
        inputs = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        out = (module.attention_weights(*inputs[:2], mask) @ inputs[2] if explicit
               else module(*inputs, mask))
        params = [module.kernel.proj, module.kernel.raw_weight, module.kernel.raw_bandwidth,
                  module.kernel.raw_background]
        return [t.double() for t in torch.autograd.grad(out, inputs + params, grad_out.to(dtype))]

    got, want = gradients(layer, torch.float32, False), gradients(reference, torch.float64, True)
    assert len(calls) == 1
    for name, a, b in zip(["q", "k", "v", "proj", "raw_weight", "raw_bandwidth", "raw_background"], got, want):
        # measured up to 3.0e-6 of the largest gradient (float32 sums)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * float(b.abs().max()), msg=name)


@needs_native
def test_native_gradients_do_not_depend_on_the_default_dtype(monkeypatch):
    """The native backward's buffers are float32 whatever torch's default dtype is (its C code writes floats)."""
    layer, (q, k, v, mask) = sixteen_value_case(PROFILES[0], 12, 300)
    q[:, :, 3] += 0.1
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(13))

    def gradients():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(layer(*inputs, mask), inputs + list(layer.parameters()), grad_out)

    want = gradients()
    torch.set_default_dtype(torch.float64)
    try:
        got = gradients()
    finally:
        torch.set_default_dtype(torch.float32)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_native
@pytest.mark.parametrize("matern", [False, True])
def test_native_pass_and_gradients_equal_the_named_reference(matern):
    """sorting_native's passes against ``sorting_attention_reference`` (the explicit N x N form beside the
    operator) in float64: values and the gradients of every input."""
    g = torch.Generator().manual_seed(21)
    x, y = torch.randn(2, 3, 4, 19, generator=g), torch.randn(2, 3, 4, 19, generator=g)
    v, w, c0 = torch.randn(2, 3, 19, 5, generator=g), torch.rand(3, 4, generator=g), torch.rand(3, generator=g)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, 13:] = False
    grad_out = torch.randn(2, 3, 19, 5, generator=g)

    def run(function, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (x, y, v, w, c0)]
        out = function(*inputs[:3], mask, *inputs[3:], matern, 1e-6)
        return [out, *torch.autograd.grad(out, inputs, grad_out.to(dtype))]

    fast = run(sorting_native.sorting_kernel_attention, torch.float32)
    want = run(sorting_native.sorting_attention_reference, torch.float64)
    for got, expected in zip(fast, want):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5 * float(expected.abs().max()))
