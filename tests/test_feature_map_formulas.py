"""Every registered feature map against its formula, written out here independently of the
library (from the method notes), on fixed random parameters and inputs in float64.

A new method must add its formula to FORMULAS: the test fails for any registered map without one.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import FEATURE_MAPS

HEAD_DIM, HEADS, TOKENS = 6, 2, 5
# Float64 throughout. Measured max |library - formula|: luna 2.1e-14 (its features reach ~100 with
# random weights), t2r 1.8e-15, hedgehog 5.6e-16.
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


# name -> (formula, whether q is scaled by head_dim**-0.5 before the map, variants' options).
# A formula that differs between the query and the key side takes a third argument, role ("query" / "key").
FORMULAS = {
    "luna": (luna_formula, False, [{}, {"fast": False}, {"shared_channels": True},
                                   {"shared_channels": True, "fast": False}, {"envelope": True},
                                   {"projections": 3, "channels": 5, "hidden": 7},
                                   {"per_head_projections": True, "feature_norm": "channel"},
                                   {"per_head_projections": True, "feature_norm": "channel", "fast": False}]),
    "t2r": (t2r_formula, True, [{}, {"feature_dim": 9}]),
    "t2r-hh": (t2r_formula, True, [{}]),
    "hedgehog": (hedgehog_formula, False, [{}]),
    "ela": (ela_formula, False, [{}, {"kernel": "l2sum"}, {"kernel": "l2sub"}]),
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
    for options in variants:
        g = torch.Generator().manual_seed(0)
        layer = LinearAttention(name, HEAD_DIM, HEADS, HEAD_DIM**-0.5, **{"dwc": False, **options}).double()
        randomise(layer, g)
        q, k = (2 * torch.randn(1, HEADS, TOKENS, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
        phi_k = layer.phi_k or layer.phi_q
        with torch.no_grad():
            got_q, got_k = layer.features(q, k)
            sided = "role" in inspect.signature(formula).parameters
            want_q = formula(layer.phi_q, q * HEAD_DIM**-0.5 if prescale else q, *(["query"] if sided else []))
            want_k = formula(phi_k, k, *(["key"] if sided else []))
        assert float(want_q.abs().max()) > 0 and float(want_k.abs().max()) > 0  # not a trivial all-zero case
        torch.testing.assert_close(got_q, want_q, rtol=0, atol=ATOL, msg=lambda m: f"{name} {options} phi(q): {m}")
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=ATOL, msg=lambda m: f"{name} {options} phi(k): {m}")
