"""Every registered feature map against its formula, written out here independently of the
library (from the method notes), on fixed random parameters and inputs in float64.

A new method must add its formula to FORMULAS: the test fails for any registered map without one.
"""

from __future__ import annotations

import math

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import FEATURE_MAPS

HEAD_DIM, HEADS, TOKENS = 6, 2, 5
# Float64 throughout. Measured max |library - formula|: luna 2.1e-14 (its features reach ~100 with
# random weights), t2r 1.8e-15, hedgehog 5.6e-16, taylor 3.6e-15, performer 2.8e-16, elu 1.1e-16, relu and
# cosformer 0, flexformer 3.3e-16, llops 3.6e-14 (degree 6 with random sketch weights: features up to ~1e3).
ATOL = 1e-13


def relu(t: torch.Tensor) -> torch.Tensor:
    return t.clamp_min(0.0)


def softmax(t: torch.Tensor) -> torch.Tensor:
    e = torch.exp(t - t.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def luna_formula(fm, x):
    """phi(x) = h(x)/sqrt(M) [psi_l(w_i.x + b_i)]_{i<=M, l<=L}, i outer, l inner;
    psi_l(u) = relu(sum_h w2[l, h] relu(w1[r, h] u + b1[r, h]) + b2[l]) with r = l (r = 0 when shared);
    h(x) = sigmoid(E x + c), one gate per channel l (1 without an envelope)."""
    psi = fm.psi
    if fm.proj is not None:  # one W, b for every head
        w, b = fm.proj.weight, fm.proj.bias
        m = w.shape[0]
        u = torch.stack([x @ w[i] + b[i] for i in range(m)], -1)  # [..., M]
    else:  # per_head_projections: W_h [d, M], b_h [1, M]
        m = fm.head_proj_weight.shape[-1]
        u = torch.stack([x[:, h] @ fm.head_proj_weight[h] + fm.head_proj_bias[h] for h in range(x.shape[1])], 1)
    channels = psi.w2.shape[0]
    per_channel = []
    for ch in range(channels):
        r = 0 if psi.w1.shape[0] == 1 else ch
        hidden = relu(u[..., None] * psi.w1[r] + psi.b1[r])  # [..., M, hidden]
        per_channel.append(relu(hidden @ psi.w2[ch] + psi.b2[ch]))  # [..., M]
    feats = torch.stack(per_channel, -1)  # [..., M, L]
    if fm.envelope is not None:
        feats = feats / (1 + torch.exp(-(x @ fm.envelope.weight.T + fm.envelope.bias)))[..., None, :]
    feats = feats / math.sqrt(m)
    if fm.options.feature_norm == "channel":  # channel l of token x: psi_l(u_i) / sum_i' psi_l(u_i'), sums to 1
        feats = feats / (feats.sum(-2, keepdim=True) + 1e-6)
    return feats.reshape(*x.shape[:-1], m * channels)


def t2r_formula(fm, x):
    """phi(x) = relu(W x + b), one W for all heads."""
    return relu(x @ fm.proj.weight.T + fm.proj.bias)


def hedgehog_formula(fm, x):
    """phi(x) = [softmax(W_h x + b_h), softmax(-(W_h x + b_h))], two softmaxes over d each, per head h."""
    out = []
    for h in range(x.shape[1]):
        z = x[:, h] @ fm.weight[h].T + fm.bias[h]
        out.append(torch.cat([softmax(z), softmax(-z)], -1))
    return torch.stack(out, 1)


def ela_formula(fm, x, role):
    """exp: exp(x/tau - c), c = max over d per query, one max over all keys and dims for keys;
    l2sum / l2sub: queries [x, ||x||^2, 1], keys [+-2x, 1, ||x||^2]."""
    kernel = fm.options.kernel
    if kernel == "exp":
        z = x / torch.exp(fm.log_temperature)
        c = z.amax(-1, keepdim=True) if role == "query" else z.amax(dim=(-2, -1), keepdim=True)
        return torch.exp(z - c)
    sq = (x * x).sum(-1, keepdim=True)
    if role == "query":
        return torch.cat([x, sq, torch.ones_like(sq)], -1)
    return torch.cat([(2 if kernel == "l2sum" else -2) * x, torch.ones_like(sq), sq], -1)


def elu_formula(fm, x):
    """phi(x) = elu(x) + 1 = x + 1 for x > 0, exp(x) for x <= 0."""
    return torch.where(x > 0, x + 1, torch.exp(x))


def relu_formula(fm, x):
    """phi(x) = max(x, 0)."""
    return relu(x)


def taylor_formula(fm, x):
    """phi(x) = [1, x / d^(1/4), x_i x_j / sqrt(d) for i < j and x_i^2 / sqrt(2 d) for i = j, pairs row by row]
    (x first projected per head, x_h P_h, with project_dim); d = head_dim. Then phi(q).phi(k) = 1 + s + s^2/2."""
    d = fm.head_dim
    if fm.projection is not None:
        x = torch.stack([x[:, h] @ fm.projection[h] for h in range(x.shape[1])], 1)
    width = x.shape[-1]
    pairs = [x[..., i] * x[..., j] / math.sqrt(d) / (math.sqrt(2) if i == j else 1)
             for i in range(width) for j in range(i, width)]
    return torch.cat([torch.ones_like(x[..., :1]), x / d**0.25, torch.stack(pairs, -1)], -1)


def performer_logits(fm, x):
    """W x~ - |x~|^2 / 2 with x~ = d^(-1/4) x: [..., m]."""
    xt = x / fm.head_dim**0.25
    return xt @ fm.random_features.T - (xt**2).sum(-1, keepdim=True) / 2


def performer_query_formula(fm, x):
    """phi(q) = m^(-1/2) (exp(W q~ - |q~|^2/2 - c_q) + kernel_epsilon), c_q = max over features, per query."""
    logits = performer_logits(fm, x)
    m = logits.shape[-1]
    return (torch.exp(logits - logits.max(-1, keepdim=True).values) + fm.options.kernel_epsilon) / math.sqrt(m)


def performer_key_formula(fm, x):
    """phi(k) = m^(-1/2) (exp(W k~ - |k~|^2/2 - c) + kernel_epsilon), c = one max over every key and feature,
    per example and head (all keys real here)."""
    logits = performer_logits(fm, x)
    m = logits.shape[-1]
    c = torch.stack([torch.stack([logits[b, h].max() for h in range(x.shape[1])]) for b in range(x.shape[0])])
    return (torch.exp(logits - c[:, :, None, None]) + fm.options.kernel_epsilon) / math.sqrt(m)


def cosformer_formula(fm, x):
    """phi(x_i) = [relu(x_i) sin(pi i / 2M), relu(x_i) cos(pi i / 2M)], i = 0..n-1, M = n (no pads, no prefix)."""
    n = x.shape[2]
    angle = torch.tensor([math.pi * i / (2 * n) for i in range(n)], dtype=x.dtype)[:, None]
    return torch.cat([relu(x) * torch.sin(angle), relu(x) * torch.cos(angle)], -1)


def flexformer_formula(fm, x, role):
    """Per head h, frequencies W_h [m, d] (and V_h for nonstationary), all keys real here:
    positive: m^(-1/2) exp(W x - |x|^2/(2 sqrt(d)) - c), c the per-query max over features (queries) or one max
    over every key and feature (keys); stationary: m^(-1/2) [cos(W x), sin(W x)]; nonstationary:
    (4m)^(-1/2) [cos(W x) + cos(V x), sin(W x) + sin(V x)]; cos/sin keys times rho = exp(|k|^2/(2 sqrt(d)) - max over
    keys of the same)."""
    d = x.shape[-1]
    out = torch.zeros(*x.shape[:-1], fm.feature_dim, dtype=x.dtype)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            xs, w = x[b, h], fm.frequencies[h]
            m = w.shape[0]
            half_sq = (xs * xs).sum(-1, keepdim=True) / (2 * math.sqrt(d))
            if fm.options.variant == "positive":
                logits = xs @ w.T - half_sq
                c = logits.max(-1, keepdim=True).values if role == "query" else logits.max()
                out[b, h] = torch.exp(logits - c) / math.sqrt(m)
                continue
            if fm.options.variant == "stationary":
                feats = torch.cat([torch.cos(xs @ w.T), torch.sin(xs @ w.T)], -1) / math.sqrt(m)
            else:
                v2 = fm.second_frequencies[h]
                feats = torch.cat([torch.cos(xs @ w.T) + torch.cos(xs @ v2.T),
                                   torch.sin(xs @ w.T) + torch.sin(xs @ v2.T)], -1) / math.sqrt(4 * m)
            out[b, h] = feats if role == "query" else feats * torch.exp(half_sq - half_sq.max())
    return out


def llops_formula(fm, x):
    """x~ = [1 (0 if homogeneous), x / sqrt(p tau_h sqrt(d))]; psi_l = r^(-1/2) prod_t <U[h, t, l], x~>;
    phi = [psi_l psi_m (l == m), sqrt(2) psi_l psi_m (l < m)], pairs row by row (x layer-normed first with qk_norm)."""
    p, d = fm.options.degree, x.shape[-1]
    if fm.options.qk_norm:  # LayerNorm without affine, eps 1e-5 (biased variance)
        x = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    tau = torch.exp(fm.log_temperature)[:, 0, 0]
    out = []
    for h in range(x.shape[1]):
        xh = x[:, h] / torch.sqrt(p * tau[h] * math.sqrt(d))
        lead = torch.zeros_like(xh[..., :1]) if fm.options.homogeneous else torch.ones_like(xh[..., :1])
        xt = torch.cat([lead, xh], -1)
        u = fm.sketch[h]  # [p/2, r, d+1]
        r = u.shape[1]
        psi = torch.ones(*xt.shape[:-1], r, dtype=x.dtype)
        for t in range(u.shape[0]):
            psi = psi * (xt @ u[t].T)
        psi = psi / math.sqrt(r)
        pairs = [psi[..., i] * psi[..., j] * (1 if i == j else math.sqrt(2)) for i in range(r) for j in range(i, r)]
        out.append(torch.stack(pairs, -1))
    return torch.stack(out, 1)


# name -> (formula, or a (query formula, key formula) pair, whether q is scaled by head_dim**-0.5 before
# the map, variants' options)
FORMULAS = {
    "elu": (elu_formula, False, [{}]),
    "relu": (relu_formula, False, [{}]),
    "taylor": (taylor_formula, False, [{}, {"project_dim": 3}]),
    "performer": ((performer_query_formula, performer_key_formula), False,
                  [{}, {"num_features": 9, "seed": 3}, {"kernel_epsilon": 1e-3}]),
    "cosformer": (cosformer_formula, False, [{}, {"prefix_neutral": False}]),
    "luna": (luna_formula, False, [{}, {"fast": False}, {"per_head_projections": False}, {"shared_channels": True},
                                   {"shared_channels": True, "fast": False}, {"envelope": True},
                                   {"projections": 3, "channels": 5, "hidden": 7},
                                   {"per_head_projections": True, "feature_norm": "channel"},
                                   {"per_head_projections": True, "feature_norm": "channel", "fast": False},
                                   {"separate_key_map": True}, {"separate_key_map": True, "fast": False}]),
    "t2r": (t2r_formula, True, [{}, {"feature_dim": 9}]),
    "t2r-hh": (t2r_formula, True, [{}]),
    "hedgehog": (hedgehog_formula, False, [{}]),
    "ela": ((lambda fm, x: ela_formula(fm, x, "query"), lambda fm, x: ela_formula(fm, x, "key")), False,
            [{}, {"kernel": "l2sum"}, {"kernel": "l2sub"}]),
    "flexformer": ((lambda fm, x: flexformer_formula(fm, x, "query"), lambda fm, x: flexformer_formula(fm, x, "key")),
                   False, [{}, {"variant": "stationary"}, {"variant": "nonstationary"},
                           {"variant": "positive", "num_frequencies": 5, "seed": 2}]),
    "llops": (llops_formula, False, [{}, {"rank": 3, "degree": 2}, {"homogeneous": True, "degree": 6, "rank": 4},
                                     {"qk_norm": True, "rank": 2}]),
}


def randomise(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter random (init is not the formula; random weights expose transposes and halves)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_feature_map_equals_its_formula(name):
    if name not in FORMULAS:
        pytest.fail(f"feature map {name!r} has no formula in tests/test_feature_map_formulas.py: add one")
    formula, prescale, variants = FORMULAS[name]
    query_formula, key_formula = formula if isinstance(formula, tuple) else (formula, formula)
    for options in variants:
        g = torch.Generator().manual_seed(0)
        layer = LinearAttention(name, HEAD_DIM, HEADS, HEAD_DIM**-0.5, **{"dwc": False, **options}).double()
        randomise(layer, g)
        # two sequences: a mixed-up batch and head axis shows. q is [B, H, N, d] as it is stored, k a view of
        # the heads split from [B, N, H * d], as the adapters pass them (maps may read that layout as it lies).
        q = 2 * torch.randn(2, HEADS, TOKENS, HEAD_DIM, generator=g, dtype=torch.float64)
        k = 2 * torch.randn(2, TOKENS, HEADS, HEAD_DIM, generator=g, dtype=torch.float64).transpose(1, 2)
        phi_k = layer.phi_k or layer.phi_q
        with torch.no_grad():
            got_q, got_k = layer.features(q, k)
            want_q = query_formula(layer.phi_q, q * HEAD_DIM**-0.5 if prescale else q)
            want_k = key_formula(phi_k, k)
        assert float(want_q.abs().max()) > 0 and float(want_k.abs().max()) > 0  # not a trivial all-zero case
        torch.testing.assert_close(got_q, want_q, rtol=0, atol=ATOL, msg=lambda m: f"{name} {options} phi(q): {m}")
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=ATOL, msg=lambda m: f"{name} {options} phi(k): {m}")
