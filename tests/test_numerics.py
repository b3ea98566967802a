"""Numerical defects of the attention math, each against a float64 reference or an exact property, on both
execution paths (native kernels where they apply, and ``LUNA_CONVERT_NATIVE=0``'s PyTorch path):

- LUNA in float16 on the PyTorch path: channel sums at trained-model activations overflowed float16;
- NaN in gives NaN out (LUNA's native channels turned NaN into 0);
- an all-padding example stays finite and leaves the other examples' gradients as they are;
- any strides of q, k, v;
- window rows that hold every real key are exact softmax (no float32 cancellation);
- Flexformer's signed variants never divide by ~0, and their key gradients pass gradcheck;
- Performer's, Flexformer's and ELA's stabilisers at large activations: rows whose keys' features underflowed
  are warned about, with their fraction (against the exact attention of the same features in float64).

The precision and mode matrix is in tests/test_properties.py.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import methods
from luna_convert.ops import native
from luna_convert.ops.reference import softmax_attention_weights

METHODS = sorted(methods())
# Every method's default, and the variants whose numerics differ (signed kernels, windows).
CONFIGS = [(m, {}) for m in METHODS] + [
    ("flexformer", {"variant": "stationary"}), ("flexformer", {"variant": "nonstationary"}),
    ("ela", {"kernel": "l2sum"}), ("hedgehog", {"window": 2}), ("llops", {"window": 2})]
CONFIG_IDS = [m + "".join(f"-{v}" for v in o.values()) for m, o in CONFIGS]


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Native kernels where they apply, or the PyTorch path (LUNA_CONVERT_NATIVE=0)."""
    if request.param == "torch":
        monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    return request.param


def layer_of(name: str, options: dict, head_dim: int = 8, heads: int = 2, seed: int = 0) -> LinearAttention:
    torch.manual_seed(seed)
    return LinearAttention(name, head_dim, heads, head_dim**-0.5, dwc=False, **options)


def qkv(batch: int, heads: int, tokens: int, head_dim: int, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, generator=g) for _ in range(3))
    return scale * q, scale * k, v


def test_luna_float16_at_trained_model_activations(path):
    """Head dim 24, q and k ~ 15 + N(0, 10^2) per coordinate (past the exp channels' span of 8): each
    channel's sum over the 24 projections passed float16's 65,504, its reciprocal was 0, and the output was
    off by 2.0 at max|v| 3.7. Now within 4 float16 eps x max|v| of float64 from the same rounded inputs and
    weights (measured 0.12 eps)."""
    layer = layer_of("luna", {}, head_dim=24)
    q, k, v = qkv(1, 2, 12, 24, scale=10.0)
    q, k, v = (t.half() for t in (q + 15, k + 15, v))
    half = copy.deepcopy(layer).half()
    with torch.no_grad():
        want = copy.deepcopy(half).double()(q.double(), k.double(), v.double())
        got = half(q, k, v)
    assert torch.isfinite(got).all()
    tolerance = 4 * torch.finfo(torch.float16).eps * float(v.abs().max())
    assert float((got.double() - want).abs().max()) <= tolerance


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
@pytest.mark.parametrize("name, options", CONFIGS, ids=CONFIG_IDS)
def test_nan_in_gives_nan_out(name, options, train, path):
    """A NaN in a query, a key or the map's first parameter reaches the outputs at real positions: a diverged
    model must not look healthy (LUNA's native channels gave 0 for NaN)."""
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    for where in ("query", "key", "parameter"):
        layer = layer_of(name, options).train(train)
        q, k, v = qkv(2, 2, 7, 8)
        if where == "query":
            q[0, 0, 2, 3] = float("nan")
        elif where == "key":
            k[0, 0, 2, 3] = float("nan")
        else:
            parameter = next(iter((layer.phi_q or layer.kernel).parameters()), None)
            if parameter is None:
                continue
            with torch.no_grad():
                parameter.view(-1)[0] = float("nan")
        with torch.set_grad_enabled(train):
            out = layer(q, k, v, key_mask=mask)
        if where == "query":
            assert out[0, 0, 2].isnan().any()
        elif where == "key":
            assert out[0, 0].isnan().any(-1).all()  # every query of that head reads the key
        else:
            assert out[mask[:, None, :, None].expand_as(out)].isnan().any()


@pytest.mark.parametrize("name, options", CONFIGS, ids=CONFIG_IDS)
def test_all_padding_example_is_finite_and_leaves_other_gradients(name, options, path):
    """An example with no real token (cosFormer: rank / length = 0 / 0; ELA's exp: -inf - -inf) gave NaN, and
    through it NaN gradients for the layer's parameters even when the loss reads only the other examples."""
    layer = layer_of(name, options).train()
    q, k, v = qkv(3, 2, 6, 8)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1] = False
    mask[2, 4:] = False

    def gradients(keep: list[int]):
        layer.zero_grad()
        inputs = [t[keep].clone().requires_grad_() for t in (q, k, v)]
        out = layer(*inputs, key_mask=mask[keep])
        real = [i for i, b in enumerate(keep) if b != 1]
        loss = (out[real] * mask[keep][real][:, None, :, None]).square().sum()
        loss.backward()
        return out, [p.grad.clone() for p in layer.parameters() if p.grad is not None], \
            [t.grad[real] for t in inputs]

    out, params, grads = gradients([0, 1, 2])
    assert torch.isfinite(out).all()
    _, params_alone, grads_alone = gradients([0, 2])
    for got, want in zip(params + grads, params_alone + grads_alone):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, options", CONFIGS, ids=CONFIG_IDS)
def test_any_strides(name, options, path):
    """Values, queries and keys whose last stride is not 1 (a transposed layout): the same outputs as
    contiguous ones (the native products read rows of unit column stride and raised for v)."""
    layer = layer_of(name, options).eval()
    q, k, v = qkv(2, 2, 7, 8)
    transposed = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v)]
    assert transposed[2].stride(-1) != 1
    with torch.no_grad():
        want = layer(q, k, v)
        torch.testing.assert_close(layer(q, k, transposed[2]), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer(*transposed), want, rtol=0, atol=1e-6)
        mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
        torch.testing.assert_close(layer(*transposed, key_mask=mask), layer(q, k, v, key_mask=mask), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["hedgehog", "llops", "taylor"])
def test_window_rows_holding_every_key_are_softmax(name, path):
    """Every real key inside each query's window: the rows are exact softmax. With q, k of trained-model size
    (x5) the linear sums over all keys minus the band's cancelled in float32: LLoPS 0.35 of max|softmax output|
    off, Taylor 5.8e-4. Now within 1e-5 of it (measured 8.7e-7)."""
    layer = layer_of(name, {"window": 4}, head_dim=16).train()
    q, k, v = qkv(2, 2, 9, 16, scale=5.0, seed=1)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 5:] = False  # example 0: keys 0..4 (any window of 4 holds them); example 1 only in rows 4
    want = softmax_attention_weights(q.double(), k.double(), 16**-0.5, mask) @ v.double()
    got = layer(q, k, v, key_mask=mask).double()
    rows = torch.zeros(2, 9, dtype=torch.bool)
    rows[0, :5] = True
    rows[1, 4] = True  # |4 - j| <= 4 for every j of 9
    scale = float(want.abs().max())
    error = (got.detach() - want).abs()[rows[:, None, :, None].expand_as(got)].max()
    assert float(error) <= 1e-5 * scale


@pytest.mark.parametrize("variant", ["stationary", "nonstationary"])
def test_flexformer_signed_variants_never_divide_by_about_zero(variant, path):
    """Right after conversion (q, k ~ N(0, 1) per coordinate) many rows' den cancel to <= 0, and max(den, 1e-12)
    gave outputs of 1e11 x max|v|. The divisor is now at least den_floor m^-1/2 |phi(q)| sum_j |phi(k_j)|, so
    |out| <= max|v| m^(1/2); the outputs are the explicit weights' (same floor) times v; and the key gradients
    pass gradcheck (the detached stabiliser scales numerator and divisor alike)."""
    layer = layer_of("flexformer", {"variant": variant}, head_dim=16).double()
    q, k, v = (t.double() for t in qkv(2, 2, 12, 16, seed=3))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False
    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k)
        den = torch.einsum("bhnf,bhmf->bhn", phi_q, phi_k * mask[:, None, :, None])
        assert (den <= 0).any()  # the case the floor is for
        out = layer(q, k, v, key_mask=mask)
        weights = layer.attention_weights(q, k, mask)
    m = layer.phi_q.frequencies.shape[1]
    assert float(out.abs().max()) <= float(v.abs().max()) * m**0.5
    torch.testing.assert_close(out, weights @ v, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda keys: layer(q, keys, v, key_mask=mask), (k.clone().requires_grad_(),))


def exact_exp_kernel_attention(layer: LinearAttention, q, k, v) -> torch.Tensor:
    """softmax_j(log sum_f exp(a_if + b_jf)) @ v in float64, the logits a, b of the map's random features (Performer,
    Flexformer positive: W x~ - |x|^2 / 2 sqrt(d)) or of ELA's exp (x / tau): the attention of the same features
    with no stabiliser at all, so nothing underflows."""
    fm, d = layer.phi_q, q.shape[-1]
    q, k, v = q.double(), k.double(), v.double()
    if layer.method == "ela":
        a, b = (x * torch.exp(-fm.log_temperature.double()) for x in (q, k))
    else:
        weight = fm.random_features.double() * d**-0.25 if layer.method == "performer" else fm.frequencies.double()
        a, b = (x @ weight.transpose(-1, -2) - x.square().sum(-1, keepdim=True) / (2 * d**0.5) for x in (q, k))
    return torch.softmax(torch.logsumexp(a[..., :, None, :] + b[..., None, :, :], -1), -1) @ v


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
@pytest.mark.parametrize("name, head_dim, scale", [("performer", 64, 5.0), ("flexformer", 64, 5.0), ("ela", 24, 100.0)])
def test_stabilised_kernels_warn_with_the_fraction_of_underflowed_rows(name, head_dim, scale, train, path):
    """At large activations a key stabiliser shared by all keys lets keys' features underflow: rows far off the
    exact attention of the same features (Performer 31 % of rows by > 0.1 at head dim 64, x5) and no sign of it.
    Now a RuntimeWarning gives the fraction of rows at risk, which holds every row off by > 1e-3; at x1 none."""
    layer = layer_of(name, {}, head_dim=head_dim).train(train)
    q, k, v = qkv(1, 2, 64, head_dim, seed=1)
    for factor, expect_warning in ((scale, True), (1.0, False)):
        with pytest.warns(RuntimeWarning) if expect_warning else _no_warning() as caught:
            with torch.set_grad_enabled(train):
                out = layer(factor * q, factor * k, v)
        off = int(((out.detach().double() - exact_exp_kernel_attention(layer, factor * q, factor * k, v)).abs()
                   .amax(-1) > 1e-3).sum())
        if expect_warning:
            counted = int(str(caught[0].message).split("(")[1].split(" of")[0])
            assert off > 0 and counted >= off
        else:
            assert off == 0


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield []


@pytest.mark.parametrize("profile", ["laplace", "matern32"])
def test_sorting_ties_take_the_explicit_forms_gradients(profile, path):
    """Identical tokens (q = k, and a key equal to another query): Laplace's e^-|t| has a kink at the tie, where the
    sorted sums counted the key on one side (slope -1; the native backward and the PyTorch path took opposite
    sides: gradients 0.46 off) and autograd of the explicit form takes sign(0) = 0. Now every gradient within float32
    rounding of the explicit form's (measured 3.6e-7)."""
    layer = layer_of("sorting", {"profile": profile})
    q, _, v = qkv(2, 2, 6, 8)
    k = q.clone()
    k[:, :, 3] = q[:, :, 1]
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 5] = False
    grad = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(1)) * mask[:, None, :, None]
    results = []
    for explicit in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = layer.kernel.weights(*inputs[:2], mask) @ inputs[2] if explicit else layer(*inputs, key_mask=mask)
        results.append(torch.autograd.grad(out, inputs + list(layer.parameters()), grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * max(1.0, float(want.abs().max())))


def test_ela_float16_gradients_are_finite():
    """ELA's exp features in float16 at x5 activations: the features' gradients (about 1 / den) overflowed
    float16 and the query and key gradients were inf and NaN. The map now computes in float32: every gradient
    finite and within 16 float16 eps x max|float64 gradient| (measured 0.57)."""
    layer = layer_of("ela", {}).half().train()
    q, k, v = (t.half() for t in qkv(2, 2, 9, 8, scale=5.0))
    grad = torch.randn(2, 2, 9, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results = []
    for dtype in (torch.float16, torch.float64):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = copy.deepcopy(layer).to(dtype)(*inputs)
        results.append(torch.autograd.grad(out.double(), inputs, grad))
    for got, want in zip(*results):
        assert torch.isfinite(got).all()
        assert float((got.double() - want).abs().max()) <= 16 * torch.finfo(torch.float16).eps * float(want.abs().max())
