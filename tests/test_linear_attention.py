"""The attention math: kernel linear attention against its explicit N x N form,
padding, precision, the DWC branch and feature-map sanity properties."""

from __future__ import annotations

import pytest
import torch

from luna_convert.layers.attention import AttentionMode, DepthwiseConvBranch, LinearAttention
from luna_convert.linear_methods import FEATURE_MAPS, build_feature_map
from luna_convert.ops.context import AttentionContext
from luna_convert.ops.layout import tokens_first
from luna_convert.ops.linear import linear_attention
from luna_convert.ops.reference import (
    EPS,
    attention_distillation_loss,
    linear_attention_weights,
    softmax_attention_weights,
)
from luna_convert.ops.streamed import streamed_linear_attention

MAPS = sorted(FEATURE_MAPS)


def explicit_attention(phi_q, phi_k, v, key_mask=None, eps=EPS):
    """Reference: A_ij = phi(q_i).phi(k_j) / (sum_m phi(q_i).phi(k_m) + eps), sums over real keys
    only, in float64 with plain loops over batch and head (independent of the library's einsums).
    eps is the library's documented guard for all-zero features (0 gives the textbook formula)."""
    b, h, n, _ = phi_q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        real = torch.arange(n) if key_mask is None else key_mask[bi].nonzero().flatten()
        for hi in range(h):
            fq, fk = phi_q[bi, hi].double(), phi_k[bi, hi, real].double()
            scores = fq @ fk.T  # [n, n_real]
            weights = scores / (scores.sum(-1, keepdim=True) + eps)
            out[bi, hi] = weights @ v[bi, hi, real].double()
    return out


def random_padding(batch: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """bool [B, N]: every row keeps a random non-empty prefix, the rest is padding."""
    lengths = torch.randint(1, n + 1, (batch,), generator=generator)
    return torch.arange(n)[None, :] < lengths[:, None]


def make_layer(name: str, head_dim: int, heads: int, seed: int = 0, **kw) -> LinearAttention:
    torch.manual_seed(seed)  # the maps' random init: the measured errors in the tolerances are for these
    kw.setdefault("dwc", False)  # the attention alone unless a test asks for the branch (LUNA's default has it)
    return LinearAttention(name, head_dim, heads, head_dim**-0.5, **kw).eval()


# ----------------------------------------------------------------- explicit formula
@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("trial", range(3))
def test_linear_attention_equals_explicit_formula(name, trial):
    g = torch.Generator().manual_seed(100 + trial)
    b, h, d = 1 + trial, int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 17, (1,), generator=g))
    n = int(torch.randint(2, 12, (1,), generator=g))
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    key_mask = random_padding(b, n, g)
    layer = make_layer(name, d, h)
    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k, AttentionContext(key_mask, n))  # what the layer's forward passes
        got = linear_attention(phi_q, phi_k, v, key_mask, layer.eps)  # the method's guard (Performer's is smaller)
        ref = explicit_attention(phi_q, phi_k, v, key_mask, layer.eps)
        # The module's own explicit matrix agrees too (it is the distillation student).
        weights = linear_attention_weights(phi_q, phi_k, key_mask, layer.eps)
    rows = key_mask[:, None, :, None].expand_as(got)  # compare real query rows (pads are free)
    # measured 2.4e-7 and 1.7e-7 (values up to 2.6)
    torch.testing.assert_close(got[rows].double(), ref[rows], atol=1.5e-6, rtol=0)
    torch.testing.assert_close((weights @ v)[rows].double(), ref[rows], atol=1.5e-6, rtol=0)
    # Pad keys get exactly zero weight, real rows sum to one.
    assert torch.all(weights.masked_select(~key_mask[:, None, None, :].expand_as(weights)) == 0)
    sums = weights.sum(-1)[key_mask[:, None, :].expand(b, h, n)]
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=5e-5, rtol=0)  # measured 6.0e-6: eps / (den + eps)


@pytest.mark.parametrize("name", MAPS)
def test_layer_forward_is_linear_attention_of_its_features(name):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    layer = make_layer(name, 8, 3)
    with torch.no_grad():
        out = layer(q, k, v)
        ref = explicit_attention(*layer.features(q, k), v, eps=layer.eps)
    torch.testing.assert_close(out.double(), ref, atol=1.5e-6, rtol=0)  # measured 2.8e-7


def test_t2r_prescales_query_and_shares_the_map():
    layer = make_layer("t2r", 16, 2)
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    phi_q, phi_k = layer.features(q, k)
    assert layer.phi_k is None
    # the same ops: exactly equal (measured 0)
    torch.testing.assert_close(phi_q, torch.relu(layer.phi_q.proj(q * 16**-0.5)), atol=0, rtol=0)
    torch.testing.assert_close(phi_k, torch.relu(layer.phi_q.proj(k)), atol=0, rtol=0)


def test_hedgehog_has_separate_query_and_key_maps():
    layer = make_layer("hedgehog", 8, 2)
    assert layer.phi_k is not None and layer.phi_k is not layer.phi_q
    assert {p.data_ptr() for p in layer.phi_q.parameters()}.isdisjoint(p.data_ptr() for p in layer.phi_k.parameters())


@pytest.mark.parametrize("name", MAPS)
def test_features_are_non_negative(name):
    fm = build_feature_map(name, 8, 2)
    feats = fm(torch.randn(2, 2, 10, 8) * 3)
    assert feats.shape[-1] == fm.feature_dim
    if fm.divisor.clamp:  # ELA's distance kernels: no sign to keep (the layer clamps the denominator)
        assert bool(torch.isfinite(feats).all())
    elif fm.signed_features:  # signed features (Taylor): the kernel itself must stay positive
        assert bool((feats < 0).any()) and bool((feats @ feats.transpose(-1, -2) > 0).all())
    else:
        assert bool((feats >= 0).all())


LUNA_VARIANTS = [
    {"shared_channels": True},
    {"envelope": True},
    {"channel_bank": "fourier"},
    {"channel_bank": "bank"},
    {"fast": False},
    {"projections": 3, "channels": 2, "hidden": 5},
]


@pytest.mark.parametrize("options", LUNA_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_luna_variants_match_explicit_formula_and_padding(options):
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 2, 7, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])
    layer = make_layer("luna", 8, 2, **options)
    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k)
        assert phi_q.shape[-1] == layer.feature_dim and bool((phi_q >= 0).all())
        out = layer(q, k, v, key_mask=mask)
        ref = explicit_attention(phi_q, phi_k, v, mask)
    rows = mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[rows].double(), ref[rows], atol=1e-6, rtol=0)  # measured 1.7e-7


def test_luna_fast_path_matches_reference_channels():
    torch.manual_seed(3)
    fast, slow = make_layer("luna", 8, 2), make_layer("luna", 8, 2, fast=False)
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(2, 2, 9, 8, requires_grad=True)
    a, b = fast.phi_q(x), slow.phi_q(x)
    torch.testing.assert_close(a, b, atol=5e-7, rtol=0)  # measured 6.0e-8
    ga, = torch.autograd.grad(a.square().sum(), x)
    gb, = torch.autograd.grad(b.square().sum(), x)
    torch.testing.assert_close(ga, gb, atol=5e-7, rtol=0)  # measured 6.0e-8


# ----------------------------------------------------------------------- padding
@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("dwc", [False, True])
def test_padding_never_changes_real_tokens(name, dwc):
    g = torch.Generator().manual_seed(3)
    d, h, n_real, n_pad = 8, 2, 5, 4
    q, k, v = (torch.randn(1, h, n_real, d, generator=g) for _ in range(3))
    layer = make_layer(name, d, h, dwc=dwc)
    if dwc:  # a non-trivial conv so the DWC branch actually mixes tokens
        with torch.no_grad():
            layer.dwc.conv.weight.normal_(generator=g)
            layer.dwc.conv.bias.normal_(generator=g)
    pad = lambda x: torch.cat([x, 50 * torch.randn(1, h, n_pad, d, generator=g)], 2)  # noqa: E731
    mask = torch.tensor([[True] * n_real + [False] * n_pad])
    with torch.no_grad():
        alone = layer(q, k, v)
        padded = layer(pad(q), pad(k), pad(v), key_mask=mask)
    torch.testing.assert_close(padded[:, :, :n_real], alone, atol=2e-6, rtol=0)  # measured 4.8e-7 (values up to 4.7)


def test_padding_mask_zeroes_phi_k_not_k():
    """phi(0) != 0 for T2R (ReLU(b) with b > 0): zeroing k instead of phi(k) would leak pads."""
    layer = make_layer("t2r", 4, 1)
    with torch.no_grad():
        layer.phi_q.proj.bias.fill_(1.0)
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[True, True, False]])
    with torch.no_grad():
        out = layer(q, k, v, key_mask=mask)
        ref = layer(q[:, :, :2], k[:, :, :2], v[:, :, :2])
    torch.testing.assert_close(out[:, :, :2], ref, atol=0, rtol=0)  # a zeroed key adds exact zeros (measured 0)


# --------------------------------------------------------------- numerics, dtypes
@pytest.mark.parametrize("name", MAPS)
def test_gradients_are_finite(name):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, 7, 8, generator=g, requires_grad=True) for _ in range(3))
    layer = make_layer(name, 8, 2, dwc=True).train()
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    layer(q, k, v, key_mask=mask).square().sum().backward()
    grads = [q.grad, k.grad, v.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
    assert len(grads) > 3
    assert all(bool(torch.isfinite(x).all()) for x in grads)
    assert any(bool(x.abs().sum() > 0) for x in grads[3:])  # the feature map learns


@pytest.mark.parametrize("name", MAPS)
def test_bf16_inputs_give_finite_output(name):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g).to(torch.bfloat16) * 4 for _ in range(3))
    layer = make_layer(name, 8, 2).to(torch.bfloat16)
    mask = torch.tensor([[True] * 9, [True] * 2 + [False] * 7])
    with torch.no_grad():
        out = layer(q, k, v, key_mask=mask)
        ref = make_layer(name, 8, 2)
        ref.load_state_dict({k_: t.float() for k_, t in layer.state_dict().items()})
        out32 = ref(q.float(), k.float(), v.float(), key_mask=mask)
    assert out.dtype == torch.bfloat16
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.float(), out32, atol=0.1, rtol=0)  # measured 0.023 (bf16, values up to 6.3)


@pytest.mark.parametrize("name", MAPS)
def test_autocast_gives_finite_output(name):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g) * 4 for _ in range(3))
    layer = make_layer(name, 8, 2, dwc=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(q, k, v, key_mask=torch.tensor([[True] * 9, [True] * 3 + [False] * 6]))
    assert bool(torch.isfinite(out).all())


def test_linear_attention_accumulates_in_fp32():
    """Many large bf16 values: the sums would lose everything in bf16; the result must stay exact-ish."""
    n = 4096
    phi_q = torch.ones(1, 1, 1, 2, dtype=torch.bfloat16)
    phi_k = torch.ones(1, 1, n, 2, dtype=torch.bfloat16)
    v = torch.ones(1, 1, n, 1, dtype=torch.bfloat16)
    v[..., -1, :] = 1000.0
    out = linear_attention(phi_q, phi_k, v)
    expected = (n - 1 + 1000.0) / n
    assert abs(out.float().item() - expected) < 0.008  # measured 0.0017 (the bf16 output's rounding)


def test_all_zero_feature_token_gives_no_nan():
    phi_q = torch.zeros(1, 1, 3, 4)
    phi_q[0, 0, 1] = 1.0  # token 0 and 2 have all-zero features
    phi_k = torch.rand(1, 1, 3, 4)
    phi_k[0, 0, 2] = 0.0
    v = torch.randn(1, 1, 3, 5)
    out = linear_attention(phi_q, phi_k, v)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out[0, 0, 0], torch.zeros(5))  # nothing attended, output 0 (not NaN)
    w = linear_attention_weights(phi_q, phi_k)
    assert bool(torch.isfinite(w).all())
    # Every key padded: still finite.
    assert bool(torch.isfinite(linear_attention(phi_k, phi_k, v, torch.zeros(1, 3, dtype=torch.bool))).all())


@pytest.mark.parametrize("name", ["luna", "t2r"])
def test_relu_maps_with_dead_features_stay_finite(name):
    layer = make_layer(name, 8, 2)
    with torch.no_grad():  # push every pre-activation negative: all features zero
        proj = layer.phi_q.proj
        if proj is not None:
            proj.weight.zero_()
            proj.bias.fill_(-5.0)
        else:  # LUNA's per-head projections (its default); the dead channels below zero every feature
            layer.phi_q.head_proj_weight.zero_()
            layer.phi_q.head_proj_bias.fill_(-5.0)
        if name == "luna":
            layer.phi_q.psi.b2.fill_(-5.0)
            layer.phi_q.psi.w2.zero_()
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    out = layer(q, k, v)
    assert torch.equal(out.detach(), torch.zeros_like(out))
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


# ------------------------------------------------------------------------- DWC
def random_dwc(g: torch.Generator, spatial: bool) -> DepthwiseConvBranch:
    """A 3-tap (3 x 3) branch over 4 channels with random weights (it is zero-initialised)."""
    dwc = DepthwiseConvBranch(4, kernel_size=3, spatial=spatial)
    with torch.no_grad():
        dwc.conv.weight.normal_(generator=g)
        dwc.conv.bias.normal_(generator=g)
    return dwc


def test_dwc_text_branch_zeroes_pads():
    g = torch.Generator().manual_seed(8)
    dwc = random_dwc(g, spatial=False)
    v = torch.randn(2, 2, 5, 4, generator=g)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    out = dwc(v, mask)
    assert torch.equal(out[1, :, 3:], torch.zeros(2, 2, 4))  # pads output nothing (bias too)
    # Appending pads (with garbage values) changes no real token.
    v_long = torch.cat([v, 100 * torch.randn(2, 2, 3, 4, generator=g)], 2)
    mask_long = torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], 1)
    torch.testing.assert_close(dwc(v_long, mask_long)[:, :, :5], out, atol=0, rtol=0)  # zeroed pads: exact (measured 0)
    # Without a mask, it is a plain per-channel conv over tokens shared by heads.
    ref = torch.nn.functional.conv1d(v[0, 1].T[None], dwc.conv.weight, dwc.conv.bias, padding=1, groups=4)[0].T
    torch.testing.assert_close(dwc(v)[0, 1], ref, atol=1.5e-6, rtol=0)  # measured 2.4e-7


def test_dwc_spatial_branch_skips_prefix_tokens():
    g = torch.Generator().manual_seed(9)
    dwc = random_dwc(g, spatial=True)
    prefix, gh, gw = 3, 2, 3
    v = torch.randn(1, 2, prefix + gh * gw, 4, generator=g)
    out = dwc(v, grid=(gh, gw), num_prefix=prefix)
    assert torch.equal(out[:, :, :prefix], torch.zeros(1, 2, prefix, 4))
    grid = v[0, 0, prefix:].reshape(gh, gw, 4).permute(2, 0, 1)[None]
    ref = torch.nn.functional.conv2d(grid, dwc.conv.weight, dwc.conv.bias, padding=1, groups=4)
    # measured 2.4e-7
    torch.testing.assert_close(out[0, 0, prefix:], ref[0].permute(1, 2, 0).reshape(gh * gw, 4), atol=1.5e-6, rtol=0)
    with pytest.raises(ValueError, match="patches"):
        dwc(v, grid=(3, 3), num_prefix=prefix)


@pytest.mark.parametrize("spatial", [False, True])
def test_dwc_zero_init_equals_pure_linear_attention(spatial):
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 2, 1 + 9, 8, generator=g) for _ in range(3))
    with_dwc = make_layer("luna", 8, 2, dwc=True, spatial=spatial)
    without = make_layer("luna", 8, 2, dwc=False)
    without.load_state_dict(with_dwc.state_dict(), strict=False)
    kwargs = {"grid": (3, 3), "num_prefix": 1} if spatial else {}
    with torch.no_grad():
        torch.testing.assert_close(with_dwc(q, k, v, **kwargs), without(q, k, v), atol=0, rtol=0)
        with_dwc.dwc.conv.bias.fill_(0.5)
        assert not torch.allclose(with_dwc(q, k, v, **kwargs), without(q, k, v))


# --------------------------------------------------------------- distillation
@pytest.mark.parametrize("name", MAPS)
def test_distill_mode_returns_softmax_attention_and_a_loss(name):
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    layer = make_layer(name, 8, 2)
    layer.set_mode(AttentionMode.DISTILL_ATTENTION)
    out = layer(q, k, v, key_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=8**-0.5)
    torch.testing.assert_close(out, ref, atol=1.5e-6, rtol=0)  # measured 2.4e-7
    loss = layer.distill_loss
    assert loss is not None and loss.ndim == 0 and bool(torch.isfinite(loss))
    params = list(layer.parameters())
    if params:
        loss.backward()
        assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params)
    else:  # a fixed map (ELU, ReLU, Performer, ...): the loss still reaches q and k
        layer(q.requires_grad_(), k.requires_grad_(), v, key_mask=mask)
        assert all(bool(g.abs().sum() > 0) for g in torch.autograd.grad(layer.distill_loss, (q, k)))


def test_distillation_loss_ignores_pad_rows_and_is_minimal_at_teacher():
    g = torch.Generator().manual_seed(13)
    teacher = torch.softmax(torch.randn(1, 1, 3, 3, generator=g), -1)
    mask = torch.tensor([[True, True, False]])
    other = torch.softmax(torch.randn(1, 1, 3, 3, generator=g), -1)
    assert attention_distillation_loss(teacher, teacher) < attention_distillation_loss(teacher, other)
    garbage = teacher.clone()
    garbage[:, :, 2] = 1e-9  # a pad query row's prediction must not matter
    # pad rows are dropped before the mean: exactly equal (measured 0)
    torch.testing.assert_close(attention_distillation_loss(teacher, garbage, mask),
                               attention_distillation_loss(teacher, teacher, mask), atol=0, rtol=0)


def test_softmax_weights_mask_pad_keys():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    mask = torch.tensor([[True, True, True, False]])
    w = softmax_attention_weights(q, k, 8**-0.5, mask)
    assert torch.equal(w[..., 3], torch.zeros(1, 1, 4))
    torch.testing.assert_close(w[..., :3], torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, -1)[..., :3]
                               / torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, -1)[..., :3].sum(-1, keepdim=True),
                               atol=3e-7, rtol=0)  # measured 3.0e-8


def _mean_row_kl(teacher: torch.Tensor, student: torch.Tensor) -> float:
    return float((teacher * (torch.log(teacher + 1e-12) - torch.log(student + 1e-12))).sum(-1).mean())


def test_hedgehog_at_init_approximates_peaked_softmax_better_than_t2r():
    """Sanity: Hedgehog's softmax features (W = I) are spiky like exp(q.k); ReLU(Wx+b) at a
    random init is not. With large-norm q and k the softmax rows are peaked."""
    g = torch.Generator().manual_seed(14)
    d, h, n = 16, 2, 32
    q = torch.randn(2, h, n, d, generator=g) * 3
    k = torch.cat([q[:, :, : n // 2] + 0.1 * torch.randn(2, h, n // 2, d, generator=g),
                   torch.randn(2, h, n - n // 2, d, generator=g) * 3], 2)
    teacher = softmax_attention_weights(q, k, d**-0.5)
    assert float(teacher.max(-1).values.mean()) > 0.5  # peaked
    kl = {}
    for name in ("hedgehog", "t2r"):
        torch.manual_seed(0)
        layer = make_layer(name, d, h)
        with torch.no_grad():
            kl[name] = _mean_row_kl(teacher, layer.attention_weights(q, k))
    assert kl["hedgehog"] < kl["t2r"], kl


@pytest.mark.parametrize("spatial", [False, True])
def test_dwc_branch_gradients_match_torch_conv_and_keep_dtype(spatial):
    g = torch.Generator().manual_seed(11)
    dwc = random_dwc(g, spatial=spatial)
    v = torch.randn(2, 3, 9, 4, generator=g, requires_grad=True)
    kwargs = {"grid": (3, 3)} if spatial else {}
    out = dwc(v, **kwargs)
    # Reference: torch's own depthwise conv on the channels-first layout.
    x = v.reshape(6, 3, 3, 4).permute(0, 3, 1, 2) if spatial else v.reshape(6, 9, 4).transpose(1, 2)
    ref = dwc.conv(x)
    ref = (ref.permute(0, 2, 3, 1) if spatial else ref.transpose(1, 2)).reshape(2, 3, 9, 4)
    torch.testing.assert_close(out, ref, atol=5e-6, rtol=0)  # measured 9.5e-7 (values up to 9.9)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (v, dwc.conv.weight, dwc.conv.bias), grad)
    want = torch.autograd.grad(ref, (v, dwc.conv.weight, dwc.conv.bias), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)  # measured 4.3e-6 (gradients up to 12)
    half = dwc(v.detach().bfloat16(), **kwargs)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), out.detach(), atol=0.2, rtol=0)  # measured 0.062 (bf16, values up to 9.9)


# ------------------------------------------------------------------------- streamed path
def streamed_and_plain(name, **kw):
    """Two identical layers: one streams every input in chunks of 16 tokens, the other never streams."""
    plain = make_layer(name, 8, 3, **kw).train()
    streamed = make_layer(name, 8, 3, **kw).train()
    streamed.load_state_dict(plain.state_dict())
    plain.stream_min_bytes = 1 << 62
    streamed.stream_min_bytes, streamed.stream_chunk_bytes = 0, 1  # chunk = 16 tokens
    return plain, streamed


def test_stream_chunk_policy():
    t2r, luna = make_layer("t2r", 64, 12), make_layer("luna", 64, 12)
    assert t2r.stream_chunk(1, 2048) is None  # 6 MiB of features: the plain path
    assert t2r.stream_chunk(1, 16384) == (16 << 20) // (12 * 64 * 4)  # 48 MiB: 16 MiB chunks
    assert luna.stream_chunk(1, 16384) is None  # training: its kernel already works in chunks
    assert luna.stream_chunk(1, 16384, training=False) is not None  # inference streams
    assert make_layer("luna", 64, 12, fast=False).stream_chunk(1, 16384) is not None


def test_layer_takes_the_streamed_path_only_where_policy_says(monkeypatch):
    """The layer's forward routes long inputs through ops.streamed.streamed_linear_attention (and agrees with the plain path)."""
    import luna_convert.layers.attention as attention

    calls = []
    real = attention.streamed_linear_attention
    monkeypatch.setattr(attention, "streamed_linear_attention",
                        lambda *a, **k: calls.append((name, torch.is_grad_enabled(), a[-1])) or real(*a, **k))
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    for name in ("luna", "t2r"):
        layer = make_layer(name, 8, 2)
        layer.stream_min_bytes, layer.stream_chunk_bytes = 1000, 1  # above 1000 bytes: chunks of 16 tokens
        with torch.no_grad():
            streamed = layer(q, k, v)
            layer.stream_min_bytes = 1 << 62
            torch.testing.assert_close(streamed, layer(q, k, v), rtol=0, atol=1.5e-6)  # measured 2.4e-7
        layer.stream_min_bytes = 1000
        layer(q, k, v.requires_grad_()).sum().backward()
        v.requires_grad_(False)
    # luna and t2r stream at inference, t2r in training too; luna trains on the plain path
    assert calls == [("luna", False, 16), ("t2r", False, 16), ("t2r", True, 16)]


# The layer streams token-wise maps only (LinearAttention.stream_chunk): a map with a stabiliser over
# all keys (token_wise = False) is never given chunks.
STREAMED_MAPS = [name for name in MAPS if FEATURE_MAPS[name].token_wise]


def _has_parameters(name: str) -> bool:
    return name == "luna-reference" or any(True for _ in make_layer(name, 8, 3).parameters())


# Without input gradients only the maps' parameters have gradients: parameter-free maps are left out there.
STREAM_CASES = [(name, True) for name in STREAMED_MAPS + ["luna-reference"]] + \
    [(name, False) for name in STREAMED_MAPS + ["luna-reference"] if _has_parameters(name)]


@pytest.mark.parametrize("name, inputs_need_grad", STREAM_CASES)
def test_streamed_path_matches_plain_values_and_gradients(name, inputs_need_grad):
    """ops.streamed.streamed_linear_attention against the plain layer: output and every gradient."""
    g = torch.Generator().manual_seed(12)
    layer = make_layer("luna", 8, 3, fast=False) if name == "luna-reference" else make_layer(name, 8, 3)
    layer.train().stream_min_bytes = 1 << 62
    if not layer.phi_q.token_wise:  # e.g. Performer's key stabiliser over all real keys: never streamed
        layer.stream_min_bytes = 0
        assert layer.stream_chunk(2, 37) is None and layer.stream_chunk(2, 37, training=False) is None
        return
    params = list(layer.parameters())
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g) for _ in range(3))
    key_mask = torch.arange(37)[None, :] < torch.tensor([[37], [20]])  # the second row ends in a padded chunk
    grad = torch.randn(2, 3, 37, 8, generator=g)
    context = AttentionContext(key_mask, 37)  # as the layer's forward builds it (positions for cosFormer)

    def streamed(q, k, v, key_mask):
        return streamed_linear_attention(q, k, v, layer.query_features, layer.key_features, params,
                                         key_mask, layer.eps, chunk=16, q_context=context,
                                         k_context=context.for_role("key"))

    results = []
    for fn in (layer, streamed):
        x = [t.clone().requires_grad_(inputs_need_grad) for t in (q, k, v)]
        out = fn(*x, key_mask=key_mask)
        wrt = (x if inputs_need_grad else []) + params
        results.append((out.detach(), torch.autograd.grad(out, wrt, grad, allow_unused=True)))
    (out_p, grads_p), (out_s, grads_s) = results
    torch.testing.assert_close(out_s, out_p, rtol=0, atol=1.5e-6)  # measured 2.4e-7
    assert len(grads_p) == len(grads_s) > 0
    for a, b in zip(grads_p, grads_s):
        assert a is not None and a.abs().sum() > 0
        torch.testing.assert_close(b, a, rtol=0, atol=4e-5)  # measured 8.6e-6 (gradients up to 7.9)


def test_streamed_path_under_bf16_autocast_and_no_grad():
    g = torch.Generator().manual_seed(13)
    plain, streamed = streamed_and_plain("hedgehog")
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(streamed(q, k, v), plain(q, k, v), rtol=0, atol=1e-6)  # measured 1.8e-7
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_p, out_s = plain(q, k, v.bfloat16()), streamed(q, k, v.bfloat16())
        assert out_s.dtype == out_p.dtype == torch.bfloat16
        torch.testing.assert_close(out_s.float(), out_p.float(), rtol=0, atol=0.015)  # measured 3.9e-3 (bf16)
        out_s.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in streamed.phi_q.parameters())


# Small maps so that gradcheck's numerical Jacobian stays quick.
SMALL_OPTIONS = {"luna": {"projections": 2, "channels": 2, "hidden": 3}, "t2r": {"feature_dim": 6},
                 "t2r-hh": {"feature_dim": 6}}


@pytest.mark.parametrize("name, path", [(name, path) for path in ("plain", "streamed") for name in MAPS
                                        if path == "plain" or name in STREAMED_MAPS])
def test_float64_is_computed_in_float64(name, path):
    """float64 inputs keep their precision on both paths: values match the float64
    explicit N x N form to ~1e-12 (float32 arithmetic is off by ~1e-7) and gradcheck passes."""
    g = torch.Generator().manual_seed(15)
    torch.manual_seed(15)
    layer = make_layer(name, 4, 2, dwc=True, **SMALL_OPTIONS.get(name, {})).double()
    layer.stream_min_bytes = 1 << 62
    with torch.no_grad():
        layer.dwc.conv.weight.normal_(generator=g)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True] * 5 + [False] * 2])
    params = list(layer.parameters())

    context = AttentionContext(mask, 7)
    if path == "streamed" and not layer.phi_q.token_wise:
        pytest.skip(f"{name} is not token-wise: it never takes the streamed path")

    def forward(q, k, v, *_params):  # gradcheck perturbs the parameters in place
        if path == "plain":
            return layer(q, k, v, key_mask=mask)
        out = streamed_linear_attention(q, k, v, layer.query_features, layer.key_features,
                                        [p for m in (layer.phi_q, layer.phi_k) if m is not None for p in m.parameters()],
                                        mask, layer.eps, chunk=3, q_context=context, k_context=context.for_role("key"))
        return out + layer.dwc(v, mask)

    with torch.no_grad():
        out = forward(q, k, v)
        ref = explicit_attention(*layer.features(q, k, context), v, mask, layer.eps) + layer.dwc(v, mask)  # the method's own eps
    assert out.dtype == torch.float64
    rows = mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[rows], ref[rows], rtol=0, atol=5e-15)  # measured 8.9e-16
    assert torch.autograd.gradcheck(forward, (q, k, v, *params))


def test_tokens_first_is_the_transposed_view_and_hands_back_a_contiguous_gradient():
    """Features built [.., D, N] get their gradient in that layout, contiguous (Taylor's and LLoPS's backward
    passes read it along rows); a plain transpose hands on a gradient strided across them."""
    built = torch.randn(2, 3, 5, 7, requires_grad=True)  # [B, H, D, N]
    weights = torch.randn(2, 3, 5, 7)
    seen = []
    built.register_hook(lambda grad: seen.append(grad.is_contiguous()))
    for hand_on in (tokens_first, lambda x: x.transpose(-1, -2)):
        view = hand_on(built)
        assert torch.equal(view, built.transpose(-1, -2))
        torch.bmm(view.reshape(6, 7, 5), weights.reshape(6, 5, 7)).sum().backward()
    assert seen == [True, False]
    # each pass adds sum_m weights[.., j, m] to every token of feature j
    torch.testing.assert_close(built.grad, 2 * weights.sum(-1, keepdim=True).expand(2, 3, 5, 7))

