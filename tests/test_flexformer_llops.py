"""Flexformer's three variants and LLoPS: each layer's output and gradients against the explicit N x N attention of
its own kernel k(q_i, k_j), written here from the kernels (not from the feature maps), in float64 on padded
batches; the initialisations that make the fresh layer softmax's estimate; the signed variants' guard; seeds, save
+ load of the trained tensors, and bf16 autocast in a converted BERT."""

from __future__ import annotations

import math

import pytest
import torch

from luna_convert.conversion import convert, linear_attention_modules
from luna_convert.layers.attention import LinearAttention
from luna_convert.ops.reference import softmax_attention
from luna_convert.serialization import load, save

from conftest import example_inputs, logits_of, make_bert

D = 6
MASK = torch.tensor([[True] * 7, [False, True, True, False, True, True, False]])  # holes and left pads


def flexformer_kernel(fm, q, k):
    """[n, n] for one head's frequencies (fm.frequencies[h] given as w, v): the kernels themselves.
    positive: (1/m) sum_r exp(w_r.q - |q|^2/2sqrt(d)) exp(w_r.k - |k|^2/2sqrt(d));
    stationary: e^(|k|^2/2sqrt(d)) (1/m) sum_r cos(w_r.(q - k));
    nonstationary: e^(|k|^2/2sqrt(d)) (1/4m) sum_r [cos(w_r.(q-k)) + cos(v_r.(q-k)) + cos(w_r.q - v_r.k) + cos(v_r.q - w_r.k)]."""
    w, v, variant = fm["w"], fm["v"], fm["variant"]
    d, m = q.shape[-1], w.shape[0]
    nq, nk = (q * q).sum(-1) / (2 * math.sqrt(d)), (k * k).sum(-1) / (2 * math.sqrt(d))
    if variant == "positive":
        return torch.exp(q @ w.T - nq[:, None]) @ torch.exp(k @ w.T - nk[:, None]).T / m
    diff = q[:, None, :] - k[None, :, :]  # [n, n, d]
    if variant == "stationary":
        kern = torch.cos(diff @ w.T).sum(-1) / m
    else:
        kern = (torch.cos(diff @ w.T) + torch.cos(diff @ v.T) + torch.cos((q @ w.T)[:, None] - (k @ v.T)[None])
                + torch.cos((q @ v.T)[:, None] - (k @ w.T)[None])).sum(-1) / (4 * m)
    return kern * torch.exp(nk)[None, :]


def llops_kernel(fm, q, k):
    """(<psi(q), psi(k)>)^2 with <psi(q), psi(k)> = (1/r) sum_l prod_t <u_tl, q~> <u_tl, k~>, x~ = [1, x/sqrt(p tau sqrt(d))]."""
    u, tau, p = fm["u"], fm["tau"], fm["degree"]
    d = q.shape[-1]
    lift = lambda x: torch.cat([torch.ones_like(x[:, :1]), x / torch.sqrt(p * tau * math.sqrt(d))], -1)  # noqa: E731
    qt, kt = lift(q), lift(k)
    inner = torch.ones(q.shape[0], k.shape[0], u.shape[1], dtype=q.dtype)
    for t in range(u.shape[0]):
        inner = inner * (qt @ u[t].T)[:, None, :] * (kt @ u[t].T)[None, :, :]
    return (inner.sum(-1) / u.shape[1]) ** 2


def head_params(layer, h):
    fm = layer.phi_q
    if layer.method == "llops":
        return {"u": fm.sketch[h], "tau": torch.exp(fm.log_temperature[h, 0, 0]), "degree": fm.options.degree}
    return {"w": fm.frequencies[h], "v": None if fm.second_frequencies is None else fm.second_frequencies[h],
            "variant": fm.options.variant}


def explicit_attention(layer, q, k, v, mask):
    """out_i = sum_j k(q_i, k_j) v_j / sum_j k(q_i, k_j) over the real keys, for the real queries (others 0)."""
    kernel = llops_kernel if layer.method == "llops" else flexformer_kernel
    out = torch.zeros_like(v)
    for b in range(q.shape[0]):
        real = mask[b].nonzero().flatten()
        for h in range(q.shape[1]):
            weights = kernel(head_params(layer, h), q[b, h, real], k[b, h, real])
            den = weights.sum(-1, keepdim=True)
            assert bool((den > 0).all())  # inputs where the signed kernels' eps guard does not engage
            floor = layer.divisor.floor
            if floor is not None:  # den at least floor |phi(q_i)| sum_j |phi(k_j)|, |phi(x)|^2 = k(x, x) without rho
                params = head_params(layer, h)
                norms = [(kernel(params, x, x).diagonal() / torch.exp((x * x).sum(-1) / (2 * math.sqrt(D)))).sqrt()
                         for x in (q[b, h, real], k[b, h, real])]
                rho = torch.exp((k[b, h, real] ** 2).sum(-1) / (2 * math.sqrt(D)))
                den = torch.maximum(den, floor * norms[0][:, None] * (norms[1] * rho).sum())
            # llops' den is unstabilised, so its eps guard is in the same units (flexformer's 1e-12 meets a
            # stabilised den and is left out)
            out[b, h, real] = weights / (den + (layer.eps if layer.method == "llops" else 0.0)) @ v[b, h, real]
    return out


CASES = [("flexformer", {}), ("flexformer", {"variant": "stationary"}), ("flexformer", {"variant": "nonstationary"}),
         ("flexformer", {"variant": "nonstationary", "nonstationary_offset": 1.0, "num_frequencies": 5}),
         ("llops", {}), ("llops", {"rank": 3, "degree": 6})]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for name, o in CASES]


def layer_of(name, **options):
    torch.manual_seed(0)
    layer = LinearAttention(name, D, 2, D**-0.5, **{"dwc": False, **options}).double()
    if name == "llops":
        with torch.no_grad():
            layer.phi_q.log_temperature.copy_(torch.tensor([0.2, -0.3]).view(2, 1, 1))  # tau != 1 exercised
    return layer


@pytest.mark.parametrize("name, options", CASES, ids=IDS)
def test_output_gradients_and_padding_equal_the_explicit_kernel_attention(name, options):
    g = torch.Generator().manual_seed(1)
    layer = layer_of(name, **options)
    # scale 0.5: RFF kernels with den > 0 on every row (checked in explicit_attention)
    q, k, v = (0.5 * torch.randn(2, 2, 7, D, generator=g, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad = torch.randn(2, 2, 7, D, generator=g, dtype=torch.float64) * MASK[:, None, :, None]  # real rows only
    got = layer(q, k, v, key_mask=MASK)
    want = explicit_attention(layer, q, k, v, MASK)
    rows = MASK[:, None, :, None].expand_as(got)
    # float64: measured 6.1e-12 (values) and 1.9e-11 (gradients up to 1.4) for the positive variant (its 1e-12 eps
    # meets the stabilised den, the reference has none), at most 4.4e-16 and 3.6e-15 (up to 8.3) for the others
    torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=1e-10)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    with torch.no_grad():  # pads of any size change no real row (the key weight's max runs over real keys)
        noisy = lambda x: torch.where(MASK[:, None, :, None], x, 40 * torch.randn(x.shape, generator=g,  # noqa: E731
                                                                                   dtype=x.dtype))
        padded = layer(noisy(q), noisy(k), noisy(v), key_mask=MASK)
        for b in range(2):
            real = MASK[b].nonzero().flatten()
            alone = layer(q[b:b + 1, :, real], k[b:b + 1, :, real], v[b:b + 1, :, real])
            torch.testing.assert_close(padded[b:b + 1, :, real], alone, rtol=0, atol=1e-12)  # measured 4.4e-16


@pytest.mark.parametrize("name, options", CASES[:3] + CASES[4:5], ids=IDS[:3] + IDS[4:5])
def test_gradcheck_including_the_method_parameters(name, options):
    g = torch.Generator().manual_seed(2)
    layer = LinearAttention(name, 3, 2, 3**-0.5, dwc=False, **options,
                            **({"rank": 2} if name == "llops" else {"num_frequencies": 3})).double()
    q, k, v = (torch.randn(2, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True] * 4, [True, False, True, False]])
    assert torch.autograd.gradcheck(lambda q, k, v, *p: layer(q, k, v, key_mask=mask), (q, k, v, *layer.parameters()))


@pytest.mark.parametrize("variant", ["positive", "stationary"])
def test_flexformer_init_is_the_gaussian_rff_estimate_of_softmax(variant):
    """With many frequencies the fresh layer is softmax attention (the norm factor rho included): the frequencies
    are N(0, I/sqrt(d)). Small logits keep the RFF variance small."""
    g = torch.Generator().manual_seed(3)
    d = 8
    q, k, v = (torch.randn(1, 1, 12, d, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = 0.35 * q, 0.35 * k + 0.5 * torch.linspace(-1, 1, 12, dtype=torch.float64)[:, None]  # key norms differ
    layer = LinearAttention("flexformer", d, 1, d**-0.5, dwc=False, variant=variant, num_frequencies=20000).double()
    with torch.no_grad():
        got = layer(q, k, v)
        want = softmax_attention(q, k, v, d**-0.5)
        w = layer.phi_q.frequencies[0].detach()
    # a 20,000-frequency Monte-Carlo estimate, measured 6.8e-3 (positive; 1.0e-2 at seed 1) and 1.6e-3 (stationary;
    # 2.1e-3 at seed 1); softmax itself is 0.15 away from uniform rows here
    torch.testing.assert_close(got, want, rtol=0, atol={"positive": 2e-2, "stationary": 5e-3}[variant])
    assert abs(float(w.var()) * math.sqrt(d) - 1) < 0.02  # variance 1/sqrt(d) per entry (measured 0.7% off)


def test_llops_init_sketches_the_exp_matching_polynomial():
    """E <psi(q), psi(k)> = <q~, k~>^2 = (1 + s/4)^2 over the Gaussian sketch: with rank 1500 the kernel
    phi(q).phi(k) = <psi(q), psi(k)>^2 is close to (1 + s/4)^4 (tau = 1, s = q.k/sqrt(d))."""
    g = torch.Generator().manual_seed(4)
    d = 4
    q, k = (0.8 * torch.randn(1, 1, 5, d, generator=g, dtype=torch.float64) for _ in range(2))
    layer = LinearAttention("llops", d, 1, d**-0.5, dwc=False, rank=1500).double()
    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k)
    got = (phi_q @ phi_k.transpose(-1, -2))[0, 0]
    s = (q @ k.transpose(-1, -2))[0, 0] / math.sqrt(d)
    want = (1 + s / 4) ** 4
    # measured at most 6.6% relative: the sketch's Monte-Carlo error at rank 1500
    torch.testing.assert_close(got, want, rtol=0.15, atol=0)
    assert layer.feature_dim == 1500 * 1501 // 2


def test_flexformer_signed_variants_clamp_and_stay_finite_when_den_is_negative():
    layer = LinearAttention("flexformer", 8, 1, 8**-0.5, dwc=False, variant="stationary", num_frequencies=2)
    assert layer.divisor.clamp and layer.phi_q.signed_features and layer.stream_chunk(1, 10**6) is None
    assert not LinearAttention("flexformer", 8, 1, 8**-0.5).divisor.clamp  # positive: den + eps
    g = torch.Generator().manual_seed(5)
    q, k, v = (5 * torch.randn(1, 1, 64, 8, generator=g) for _ in range(3))  # 2 frequencies at large norms
    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k)
        out = layer(q, k, v)
    assert bool((phi_q @ phi_k.sum(-2, keepdim=True).transpose(-1, -2) < 0).any())  # the guard engages
    assert bool(torch.isfinite(out).all())


def test_flexformer_nonstationary_with_tied_sets_is_stationary_and_seeds_are_recorded():
    tied = LinearAttention("flexformer", 8, 2, 8**-0.5, variant="nonstationary", nonstationary_offset=0.0)
    stationary = LinearAttention("flexformer", 8, 2, 8**-0.5, variant="stationary")
    other = LinearAttention("flexformer", 8, 2, 8**-0.5, variant="stationary", seed=1)
    assert torch.equal(tied.phi_q.frequencies, stationary.phi_q.frequencies)
    assert not torch.equal(other.phi_q.frequencies, stationary.phi_q.frequencies)
    assert not torch.equal(stationary.phi_q.frequencies[0], stationary.phi_q.frequencies[1])  # one draw per head
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(tied(q, k, v), stationary(q, k, v), rtol=0, atol=1e-6)  # measured 6e-8
    a, b = LinearAttention("llops", 8, 2, 0.35), LinearAttention("llops", 8, 2, 0.35, seed=4)
    assert torch.equal(a.phi_q.sketch, LinearAttention("llops", 8, 2, 0.35).phi_q.sketch)
    assert not torch.equal(a.phi_q.sketch, b.phi_q.sketch)


@pytest.mark.parametrize("name, options", [("flexformer", {"variant": "nonstationary", "seed": 5}),
                                           ("flexformer", {"variant": "positive"}), ("llops", {"seed": 3})])
def test_trained_tensors_round_trip_and_bf16_autocast_stays_finite(name, options, tmp_path):
    """load() reads the frequencies / sketch from model.safetensors (not redrawn from the seed); bf16 is finite."""
    model = make_bert()
    convert(model, name, **options)
    with torch.no_grad():
        for la in linear_attention_modules(model):
            for p in la.method_parameters():
                p.mul_(1.1).add_(0.01)  # not what the seed draws: "trained"
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        expected = logits_of(model, inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = logits_of(model, inputs)
    assert bool(torch.isfinite(low).all())
    torch.testing.assert_close(low.float(), expected, rtol=0, atol=0.1)  # measured at most 1.6e-2 (bf16 matmuls)
    loaded = load(save(model, tmp_path / "model"))
    for la_saved, la_loaded in zip(linear_attention_modules(model), linear_attention_modules(loaded)):
        assert la_loaded.options == la_saved.options
        for a, b in zip(la_saved.method_parameters(), la_loaded.method_parameters()):
            assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), expected)
