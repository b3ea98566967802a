"""The fast LUNA channel bank (linear_methods.luna_kernel) against the reference ScalarChannels.forward,
and the generic fast ops (ops.linear, ops.dwc, ops.streamed) against their references."""

from __future__ import annotations

import math

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods.luna import PAPER_OPTIONS, LunaFeatureMap, ScalarChannels
from luna_convert.ops.normalize import sum_normalize
from luna_convert.linear_methods.luna_kernel import KnotLocator, channel_tables, scalar_channels
from luna_convert.ops import dwc, native, streamed
from luna_convert.ops.context import AttentionContext
from luna_convert.ops.linear import linear_attention, linear_attention_core
from luna_convert.ops.reference import linear_attention_weights


def _bank(shared: bool, channels: int = 8, hidden: int = 64, dtype=torch.float32, seed: int = 0) -> ScalarChannels:
    torch.manual_seed(seed)
    psi = ScalarChannels(channels, hidden, shared=shared).to(dtype)
    with torch.no_grad():
        # Constant units (w1 == 0), one switched on (b1 > 0) and one off, and two tied knots.
        psi.w1[0, 0], psi.b1[0, 0] = 0.0, 0.7
        psi.w1[0, 1], psi.b1[0, 1] = 0.0, -0.3
        psi.w1[-1, 2], psi.b1[-1, 2] = psi.w1[-1, 3].item(), psi.b1[-1, 3].item()
        psi.w1[-1, 4], psi.b1[-1, 4] = -psi.w1[-1, 3].item(), -psi.b1[-1, 3].item()  # same knot, other direction
    return psi


def _grads(out: torch.Tensor, inputs, grad: torch.Tensor):
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("shared", [False, True])
def test_matches_reference_values_and_gradients(shared):
    psi = _bank(shared)
    u = (torch.randn(2, 3, 200, 8) * 2.5).requires_grad_()
    params = [u, *psi.parameters()]
    ref = psi(u)
    fast = scalar_channels(u, psi)
    assert fast.shape == ref.shape == (2, 3, 200, 8, 8)
    assert fast.dtype == ref.dtype
    torch.testing.assert_close(fast, ref, rtol=0, atol=5e-6)  # measured 9.5e-7 (values up to 7)
    grad = torch.randn_like(ref)
    for name, a, b in zip(["u", "w1", "b1", "w2", "b2"], _grads(ref, params, grad), _grads(fast, params, grad)):
        scale = b.abs().max().clamp_min(1.0)
        # measured 5.4e-7 (scaled to max 1)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=3e-6, msg=f"gradient of {name}")


@pytest.mark.parametrize("shared", [False, True])
def test_fp64_gradcheck(shared):
    psi = _bank(shared, channels=3, hidden=5, dtype=torch.float64, seed=1)
    u = (torch.randn(1, 2, 7, 2, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, *p: scalar_channels(x, psi), (u, *psi.parameters()), eps=1e-6, atol=1e-6)
    # ... and the analytic gradients equal the reference's.
    grad = torch.randn(1, 2, 7, 2, 3, dtype=torch.float64)
    inputs = [u, *psi.parameters()]
    for a, b in zip(_grads(psi(u), inputs, grad), _grads(scalar_channels(u, psi), inputs, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)  # measured 1.3e-15


def test_scale_is_folded_in():
    psi = _bank(False)
    u = torch.randn(4, 8)
    # measured 4.5e-8
    torch.testing.assert_close(scalar_channels(u, psi, scale=0.25), psi(u) * 0.25, rtol=0, atol=3e-7)
    with pytest.raises(ValueError):
        scalar_channels(u, psi, scale=-1.0)


def test_inputs_outside_and_on_the_knots():
    psi = _bank(False)
    knots, _, _ = channel_tables(psi)
    finite = knots[torch.isfinite(knots)].float()
    u = torch.cat([finite, finite + 1e-3, finite - 1e-3, torch.tensor([-1e6, 1e6, 0.0])]).view(-1, 1)
    # measured: 9.5e-7 absolute on values < 1, 1.4e-6 relative on larger ones (up to 6.7e5 at u = 1e6)
    torch.testing.assert_close(scalar_channels(u, psi), psi(u), rtol=5e-6, atol=5e-6)


def test_locator_matches_searchsorted():
    torch.manual_seed(0)
    knots = torch.cat([torch.randn(300), torch.randn(200) * 100, torch.tensor([float("-inf"), float("inf"), float("inf")])])
    knots = knots.sort().values
    loc = KnotLocator(knots, use_grid=True)
    assert loc.mapping == "squashed"  # heavy tails and an infinite knot: the grid in x / (1 + |x|)
    u = torch.cat([torch.randn(5000) * 3, torch.randn(1000) * 300, knots[1:-2], torch.tensor([float("inf"), float("-inf")])])
    assert torch.equal(loc(u), torch.searchsorted(knots, u))
    # knots in a bounded range (the exp init's, moved by training): equal cells from the lowest to the highest
    bounded = (torch.linspace(-8, 8, 64) + torch.rand(64) * 0.2).sort().values
    loc = KnotLocator(bounded, use_grid=True)
    assert loc.mapping == "linear"
    edges = torch.cat([bounded, bounded.nextafter(torch.tensor(-1e9)), bounded.nextafter(torch.tensor(1e9))])
    v = torch.cat([u, edges, torch.tensor([float("nan"), -9.0, 9.0])])
    expected = torch.searchsorted(bounded, v)
    expected[-3] = 0  # NaN: the first interval (searchsorted puts it past every knot)
    assert torch.equal(loc(v), expected)
    crowded = torch.zeros(64)  # every knot in one cell: falls back to searchsorted
    loc = KnotLocator(crowded, use_grid=True)
    assert loc.mapping == "searchsorted"
    assert torch.equal(loc(u), torch.searchsorted(crowded, u))


@pytest.mark.parametrize("dim", [-2, -1])
def test_sum_normalize_matches_autograd_of_its_formula(dim):
    """Values and gradients of ``ops.normalize.sum_normalize`` against x / (x.sum(dim) + eps) in plain
    autograd (float64), with a row of zeros (a channel zero on every projection) among them."""
    torch.manual_seed(0)
    x = torch.rand(2, 3, 5, 4, dtype=torch.float64)
    x[0, 1, 2].zero_()
    x[1, 0, :, 1] = 0.0
    grad = torch.randn_like(x)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    got, want = sum_normalize(xs[0], dim, 1e-6), xs[1] / (xs[1].sum(dim, keepdim=True) + 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)  # measured: one rounding (x * r vs x / s)
    got.backward(grad), want.backward(grad)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-12, atol=1e-12)
    # finite differences: away from the zero rows, where a step of 1e-6 is the size of eps
    positive = (torch.rand(2, 3, 5, 4, dtype=torch.float64) + 0.1).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sum_normalize(t, dim, 1e-6), (positive,))


def test_low_precision_and_autocast():
    psi = _bank(False)
    u = torch.randn(3, 50, 8)
    ref = psi(u)
    out = scalar_channels(u.bfloat16(), psi)
    assert out.dtype == torch.bfloat16
    # measured 3.9e-3 (bf16 rounding of values up to 1.9)
    torch.testing.assert_close(out.float(), psi(u.bfloat16().float()), rtol=0, atol=1.5e-2)
    fm = LunaFeatureMap(16, 2, **PAPER_OPTIONS)  # random knots: the kernel's general case
    x = torch.randn(1, 2, 10, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fm(x)
        attn = linear_attention(y, y, x)
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), fm(x), rtol=0, atol=1e-2)  # measured 2.3e-3 (bf16 autocast)
    # backward through the kernels under autocast: finite, and close to float32's
    (g_bf16,) = torch.autograd.grad(attn.float().sum(), [x])
    (g_fp32,) = torch.autograd.grad(linear_attention(fm(x), fm(x), x).sum(), [x])
    assert torch.isfinite(g_bf16).all()
    assert (g_bf16 - g_fp32).norm() < 0.015 * g_fp32.norm()  # measured 0.0034
    del ref


def test_no_hidden_expansion_is_saved():
    """Saved for backward (distinct tensors): u, its index and each channel's gathered slope and output - not
    N x M x L x hidden."""
    psi = _bank(False)
    u = torch.randn(1, 2, 512, 8, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = scalar_channels(u, psi)
    out_bytes = out.numel() * out.element_size()
    per_token_hidden = u.numel() * psi.channels * psi.hidden * 4
    # measured 2 out_bytes + 2 u's bytes (4 KB of tables), L = 8
    assert sum(saved.values()) <= 2 * out_bytes + 2 * u.numel() * 4 + 64 * 1024
    assert sum(saved.values()) < per_token_hidden / 20


def test_cache_follows_parameter_updates():
    psi = _bank(False)
    u = torch.randn(10, 8)
    with torch.no_grad():
        first = scalar_channels(u, psi)
        psi.b2.add_(1.0)
        second = scalar_channels(u, psi)
        torch.testing.assert_close(second, psi(u), rtol=0, atol=1e-6)  # measured 2.4e-7
    assert not torch.equal(first, second)
    # Gradients still flow after cached (no-grad) calls.
    out = scalar_channels(u, psi)
    out.sum().backward()
    assert psi.w1.grad is not None and psi.b2.grad is not None


@pytest.mark.parametrize("envelope", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_feature_map_fast_equals_reference(envelope, shared):
    torch.manual_seed(0)
    fast = LunaFeatureMap(32, 4, envelope=envelope, shared_channels=shared, fast=True, **PAPER_OPTIONS)
    slow = LunaFeatureMap(32, 4, envelope=envelope, shared_channels=shared, fast=False, **PAPER_OPTIONS)
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(2, 4, 33, 32, requires_grad=True)
    a, b = fast(x), slow(x)
    torch.testing.assert_close(a, b, rtol=0, atol=5e-7)  # measured 8.9e-8
    g = torch.randn_like(a)
    ga = _grads(a, [x, *fast.parameters()], g)
    gb = _grads(b, [x, *slow.parameters()], g)
    for p, q in zip(ga, gb):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-5)  # measured 1.1e-5 (gradients up to 36)


def test_eager_inference_chunks_equal_the_mlp_and_the_recorded_path():
    """Without gradients, eager CPU code takes the tokens in chunks (``ops.piecewise.CHUNK_VALUES``): the
    same features as the MLP itself and as the path that records gradients, across chunk boundaries."""
    from luna_convert.ops.piecewise import CHUNK_VALUES

    torch.manual_seed(0)
    fast = LunaFeatureMap(64, 2)  # the conversion defaults: exp channels, the channel norm
    slow = LunaFeatureMap(64, 2, fast=False)
    with torch.no_grad():
        for p in fast.psi.parameters():  # channels away from their init, kinks everywhere
            p.add_(0.05 * torch.randn_like(p))
    slow.load_state_dict(fast.state_dict())
    x = 2 * torch.randn(1, 2, CHUNK_VALUES // 64 + 37, 64)  # two chunks, the second partial
    with native.reference_kernels():
        recorded = fast(x)
        with torch.no_grad():
            chunked, reference = fast(x), slow(x)
    assert recorded.requires_grad and not chunked.requires_grad
    torch.testing.assert_close(chunked, reference, rtol=0, atol=5e-7)
    torch.testing.assert_close(chunked, recorded.detach(), rtol=0, atol=1e-7)


def test_linear_attention_matches_explicit_form_and_gives_contiguous_feature_grads():
    torch.manual_seed(0)
    phi_q = torch.rand(2, 3, 40, 16, requires_grad=True)
    phi_k = torch.rand(2, 3, 40, 16, requires_grad=True)
    v = torch.randn(2, 3, 40, 8, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    out = linear_attention(phi_q, phi_k, v, mask)
    ref = linear_attention_weights(phi_q, phi_k, mask) @ v
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)  # measured 1.2e-7
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, [phi_q, phi_k, v], g), _grads(ref, [phi_q, phi_k, v], g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # measured 1.8e-7
    gq, gk = _grads(linear_attention(phi_q, phi_k, v), [phi_q, phi_k], g)
    assert gq.is_contiguous() and gk.is_contiguous()


def test_strided_input_and_gradient():
    """u a transposed view and an oddly strided output gradient: the one-pass kernel reshapes both."""
    psi = _bank(True)
    base = torch.randn(9, 5, requires_grad=True)
    u = base.T  # [5, 9], not contiguous
    out = scalar_channels(u, psi)
    torch.testing.assert_close(out, psi(u), rtol=0, atol=1e-6)  # measured 1.8e-7
    g = torch.randn(8, 9, 5).permute(2, 1, 0)  # [5, 9, 8], not contiguous
    for a, b in zip(_grads(out, [base, *psi.parameters()], g), _grads(psi(u), [base, *psi.parameters()], g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # measured 1.9e-6 (gradients up to 12)


def test_tables_are_the_piecewise_linear_function():
    psi = _bank(False, channels=2, hidden=5)
    knots, slope, intercept = channel_tables(psi)
    assert knots.shape == (10,) and slope.shape == intercept.shape == (11, 2)
    assert torch.all(knots[1:] >= knots[:-1])
    # Midpoints of every finite interval evaluate to the reference's inner (pre-relu) value.
    finite = knots[torch.isfinite(knots)]
    mids = torch.cat([finite[:1] - 1, (finite[1:] + finite[:-1]) / 2, finite[-1:] + 1]).double()
    idx = torch.searchsorted(knots, mids)
    w1, b1, w2, b2 = (p.double() for p in (psi.w1, psi.b1, psi.w2, psi.b2))
    inner = (torch.relu(mids[:, None, None] * w1 + b1) * w2).sum(-1) + b2
    # measured 1.1e-16
    torch.testing.assert_close(slope[idx] * mids[:, None] + intercept[idx], inner, rtol=0, atol=1e-15)
    assert math.isfinite(float(slope.detach().abs().max()))


def test_linear_attention_core_gradcheck_and_partial_grads():
    torch.manual_seed(0)
    phi_q = torch.rand(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    phi_k = torch.rand(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: linear_attention_core(a, b, c, 1e-6), (phi_q, phi_k, v))
    # Only v needs a gradient (frozen features): the other gradients are skipped, v's is right.
    fq, fk = phi_q.detach(), phi_k.detach()
    (gv,) = torch.autograd.grad(linear_attention_core(fq, fk, v, 1e-6).sum(), [v])
    (ref,) = torch.autograd.grad((linear_attention_weights(fq, fk).double() @ v).sum(), [v])
    torch.testing.assert_close(gv, ref, rtol=0, atol=2e-15)  # measured 2.2e-16
    # The key mask folded into the products (pads leave the sums; phi_k and v get no gradient there),
    # also with signed features (the clamped denominator).
    keep = torch.tensor([[True, True, False, True, False, True]])[:, None, :, None]
    signed_q = (phi_q - 0.3).detach().requires_grad_()
    for fq, clamp in ((phi_q, False), (signed_q, True)):
        assert torch.autograd.gradcheck(lambda a, b, c: linear_attention_core(a, b, c, 1e-6, clamp, keep),
                                        (fq, phi_k, v))
    out = linear_attention_core(phi_q, phi_k, v, 1e-6, keep=keep)
    ref = linear_attention_core(phi_q, phi_k * keep, v, 1e-6)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)  # measured 0
    gk, gv = torch.autograd.grad(out.square().sum(), [phi_k, v])
    assert not gk[..., ~keep[0, 0, :, 0], :].any() and not gv[..., ~keep[0, 0, :, 0], :].any()


@pytest.mark.parametrize("grid,kernel", [((37,), (3,)), ((5,), (7,)), ((6, 7), (3, 3)), ((2, 9), (5, 3))])
def test_depthwise_conv_tokens_matches_torch_conv(grid, kernel):
    torch.manual_seed(0)
    channels = 6
    conv = (torch.nn.Conv1d if len(grid) == 1 else torch.nn.Conv2d)(
        channels, channels, kernel, padding=tuple(k // 2 for k in kernel), groups=channels)
    x = torch.randn(2, 3, *grid, channels, dtype=torch.float64, requires_grad=True)
    conv = conv.double()
    # Reference: channels first, then back.
    lead = x.shape[:2]
    xc = x.reshape(-1, *grid, channels).movedim(-1, 1)
    ref = conv(xc).movedim(1, -1).reshape(*lead, *grid, channels)
    out = dwc.depthwise_conv_tokens(x, conv.weight, conv.bias)
    torch.testing.assert_close(out, ref, rtol=0, atol=4e-15)  # measured 4.4e-16
    g = torch.randn_like(ref)
    params = [x, conv.weight, conv.bias]
    for a, b in zip(_grads(out, params, g), _grads(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)  # measured 1.6e-14 (weight gradients up to 31)
    small = torch.randn(1, 2, *grid, channels, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w, b: dwc.depthwise_conv_tokens(a, w, b), (small, conv.weight, conv.bias))


def _dwc_plus_reference(x, weight, bias, addend, keep):
    """The branch written out in float64: torch's Conv1d over x m (channels first), times m, plus addend."""
    b, h, n, c = x.shape
    m = torch.ones(b, n, dtype=torch.bool) if keep is None else keep
    xm = (x.double() * m[:, None, :, None]).reshape(b * h, n, c).transpose(1, 2)
    conv = torch.nn.functional.conv1d(xm, weight.double(), None if bias is None else bias.double(),
                                      padding=weight.shape[-1] // 2, groups=c)
    return (conv.transpose(1, 2).reshape(b, h, n, c) * m[:, None, :, None]) + addend.double()


def test_depthwise_conv_tokens_plus_checks_the_grid():
    x, weight = torch.randn(1, 2, 10, 4), torch.randn(4, 1, 3, 3)
    with pytest.raises(ValueError, match="3x3 patches after 0 prefix tokens, got 10"):
        dwc.depthwise_conv_tokens_plus(x, weight, None, None, grid=(3, 3))
    with pytest.raises(ValueError, match="a Conv2d weight is needed"):
        dwc.depthwise_conv_tokens_plus(x, torch.randn(4, 1, 3), None, None, grid=(2, 5))
    with pytest.raises(ValueError, match="no key mask"):
        dwc.depthwise_conv_tokens_plus(x, weight, None, None, torch.ones(1, 10, dtype=torch.bool), grid=(3, 3),
                                       num_prefix=1)


def test_tables_cached_under_inference_mode_are_not_saved_for_backward():
    """Evaluate under inference mode, freeze the feature map, train what is around it."""
    torch.manual_seed(0)
    fm = LunaFeatureMap(8, 2, **PAPER_OPTIONS)
    reference = LunaFeatureMap(8, 2, fast=False, **PAPER_OPTIONS)
    reference.load_state_dict(fm.state_dict())
    x = torch.randn(1, 2, 6, 8)
    with torch.inference_mode():
        fm(x)
    fm.requires_grad_(False)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    fm(xs[0]).square().sum().backward()  # raised "Inference tensors cannot be saved for backward"
    reference(xs[1]).square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=5e-7)  # measured 6.0e-8


@pytest.mark.parametrize("edit", ["b2", "w1", "swap"])
def test_cache_never_returns_stale_tables_after_edits_through_data(edit):
    """``.data`` edits (EMA, weight surgery, some loaders) do not bump ``_version``."""
    psi = _bank(False)
    u = torch.randn(20, 8) * 2
    with torch.no_grad():
        scalar_channels(u, psi)
        if edit == "b2":
            psi.b2.data.add_(1.0)
        elif edit == "w1":
            psi.w1.data[3].mul_(-1.0)
        else:  # new storage, same values elsewhere
            psi.w2.data = psi.w2.data * 0.5
        # measured 3.6e-7 (float32 evaluation against the reference MLP)
        torch.testing.assert_close(scalar_channels(u, psi), psi(u), rtol=0, atol=2e-6)


def test_streamed_backward_table_scope_is_per_thread():
    """Two threads in the streamed backward at once: each uses its own tables.

    Thread A's backward recomputes its features while thread B is paused inside its own
    backward; with one module-global scope A picked up B's tables and lost their gradients."""
    import threading

    torch.manual_seed(0)
    layer = LinearAttention("luna", 8, 2, 8**-0.5, **{**PAPER_OPTIONS, "dwc": False}).train()  # the attention alone
    params = list(layer.parameters())
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    b_inside, b_release, a_inside = threading.Event(), threading.Event(), threading.Event()

    def gradients(phi):
        out = streamed.streamed_linear_attention(q, k, v, phi, layer.key_features, params, chunk=8)
        return torch.autograd.grad(out.square().sum(), params)

    def phi_a(x):
        if torch.is_grad_enabled() and not a_inside.is_set():  # the backward's recomputation
            a_inside.set()
            start_b()
            assert b_inside.wait(30)
        return layer.query_features(x)

    def phi_b(x):
        if torch.is_grad_enabled() and not b_inside.is_set():
            b_inside.set()
            b_release.wait(30)
        return layer.query_features(x)

    results, threads = {}, []

    def run_b():
        results["b"] = gradients(phi_b)

    def start_b():
        threads.append(threading.Thread(target=run_b, daemon=True))
        threads[0].start()

    try:
        results["a"] = gradients(phi_a)
    finally:
        b_release.set()
    expected = gradients(layer.query_features)
    threads[0].join(30)
    for name in ("a", "b"):
        for got, want in zip(results[name], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"thread {name}")
