"""The classic fixed-kernel baselines (elu, relu, taylor, performer, cosformer): each layer's output and
gradients against the explicit N x N attention of its own kernel k(q_i, k_j), written here from the
papers' kernels (not from their feature maps), in float64 on padded batches; and what each method
promises beyond the kernel (Performer's saved random matrix, cosFormer's positions and prefix tokens).
"""

from __future__ import annotations

import math

import pytest
import torch

from luna_convert.conversion import convert, linear_attention_modules
from luna_convert.errors import ConversionError
from luna_convert.layers.attention import LinearAttention
from luna_convert.ops.context import AttentionContext
from luna_convert.serialization import load, save

from conftest import ARCHITECTURES, example_inputs, logits_of, make_bert

CLASSIC = ["cosformer", "elu", "performer", "relu", "taylor"]


def elu_kernel(layer, q, k, ranks, length):
    return (torch.nn.functional.elu(q) + 1) @ (torch.nn.functional.elu(k) + 1).T


def relu_kernel(layer, q, k, ranks, length):
    return q.clamp_min(0) @ k.clamp_min(0).T


def taylor_kernel(layer, q, k, ranks, length):
    """1 + s + s^2 / 2 with s = q.k / sqrt(d): the second-order Taylor polynomial of exp(s)."""
    s = q @ k.T / math.sqrt(q.shape[-1])
    return 1 + s + s**2 / 2


def performer_kernel(layer, q, k, ranks, length):
    """(1/m) sum_f exp(w_f.q~ - |q~|^2/2) exp(w_f.k~ - |k~|^2/2), x~ = d^(-1/4) x: FAVOR+ without any
    stabiliser (the stabilisers must cancel)."""
    w = layer.phi_q.random_features
    qt, kt = q / q.shape[-1] ** 0.25, k / k.shape[-1] ** 0.25
    fq = torch.exp(qt @ w.T - (qt**2).sum(-1, keepdim=True) / 2)
    fk = torch.exp(kt @ w.T - (kt**2).sum(-1, keepdim=True) / 2)
    return fq @ fk.T / w.shape[0]


def cosformer_kernel(layer, q, k, ranks, length):
    """relu(q_i).relu(k_j) cos(pi (i - j) / 2M), i, j ranks among the real tokens, M the real length."""
    return (q.clamp_min(0) @ k.clamp_min(0).T) * torch.cos(math.pi * (ranks[:, None] - ranks[None, :]) / (2 * length))


KERNELS = {"elu": elu_kernel, "relu": relu_kernel, "taylor": taylor_kernel, "performer": performer_kernel,
           "cosformer": cosformer_kernel}


def explicit_kernel_attention(name, layer, q, k, v, mask):
    """out_i = sum_j k(q_i, k_j) v_j / (sum_j k(q_i, k_j) + eps) over the real keys, for the real queries (others
    0); eps is the layer's documented denominator guard."""
    out = torch.zeros_like(v)
    for b in range(q.shape[0]):
        real = mask[b].nonzero().flatten()
        ranks = torch.arange(len(real), dtype=q.dtype)
        for h in range(q.shape[1]):
            weights = KERNELS[name](layer, q[b, h, real], k[b, h, real], ranks, len(real))
            out[b, h, real] = (weights / (weights.sum(-1, keepdim=True) + layer.eps)) @ v[b, h, real]
    return out


def layer_of(name, **options):
    torch.manual_seed(0)
    return LinearAttention(name, 8, 2, 8**-0.5, **{"dwc": False, **options}).double()


MASK = torch.tensor([[True] * 9, [False, False, True, True, False, True, True, True, False]])  # holes and left pads


@pytest.mark.parametrize("name", CLASSIC)
def test_output_and_gradients_equal_the_explicit_kernel_attention(name):
    assert set(KERNELS) == set(CLASSIC)
    g = torch.Generator().manual_seed(1)
    layer = layer_of(name)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) * MASK[:, None, :, None]  # real rows only
    got = layer(q, k, v, key_mask=MASK)
    want = explicit_kernel_attention(name, layer, q, k, v, MASK)
    rows = MASK[:, None, :, None].expand_as(got)
    # float64. Performer: its eps (1e-12) is added to the stabilised den (~1e-2 here), which the unstabilised
    # reference scales differently: measured 8.3e-11 (values), 2.2e-10 (gradients up to 4.3). Others: measured at
    # most 5.6e-16 (values) and 2.7e-15 (gradients up to 2.0).
    atol = 1e-9 if name == "performer" else 1e-14
    torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=atol)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=0, atol=3 * atol)


@pytest.mark.parametrize("name", ["performer", "cosformer", "taylor"])
def test_gradcheck_through_the_layer(name):
    """The non-token-wise stabiliser (Performer), the positions (cosFormer) and the packing (Taylor)."""
    g = torch.Generator().manual_seed(2)
    layer = layer_of(name, **({"project_dim": 3} if name == "taylor" else {}))
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True] * 5, [True, False, True, True, False]])
    assert torch.autograd.gradcheck(lambda q, k, v, *p: layer(q, k, v, key_mask=mask),
                                    (q, k, v, *layer.parameters()))


# ------------------------------------------------------------------------------------ ReLU
def test_relu_all_zero_denominator_gives_zero_output_and_finite_gradients():
    layer = layer_of("relu").float()
    assert layer.eps == 1e-6  # the layer's +eps guard (AttentionOptions.eps)
    q = -torch.rand(1, 2, 4, 8) - 0.1  # every coordinate negative: phi(q) = 0
    q.requires_grad_()
    k, v = torch.randn(1, 2, 4, 8, requires_grad=True), torch.randn(1, 2, 4, 8, requires_grad=True)
    out = layer(q, k, v)
    assert torch.equal(out.detach(), torch.zeros_like(out))
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


# ---------------------------------------------------------------------------------- Taylor
def test_taylor_feature_dim_cost_and_projection():
    assert LinearAttention("taylor", 64, 1, 0.125).feature_dim == 2145  # 1 + 64 + 64 * 65 / 2
    projected = LinearAttention("taylor", 64, 2, 0.125, project_dim=16)
    assert projected.feature_dim == 1 + 16 + 16 * 17 // 2 == 153
    assert [tuple(p.shape) for p in projected.parameters()] == [(2, 64, 16)]
    with pytest.raises(ConversionError, match="project_dim"):
        convert(make_bert(), "taylor", project_dim=64)  # more than the tiny BERT's head_dim (16)


# ------------------------------------------------------------------------------- Performer
def test_performer_matrix_is_seeded_orthogonal_and_not_trained():
    a, b = LinearAttention("performer", 16, 2, 0.25), LinearAttention("performer", 16, 2, 0.25)
    other = LinearAttention("performer", 16, 2, 0.25, seed=1)
    w = a.phi_q.random_features
    assert w.shape == (int(16 * math.log(16)), 16) and torch.equal(w, b.phi_q.random_features)
    assert not torch.equal(w, other.phi_q.random_features)
    assert list(a.parameters()) == [] and "phi_q.random_features" in a.state_dict()  # a saved buffer
    block = w[:16] / w[:16].norm(dim=1, keepdim=True)  # the first block's rows are orthonormal directions
    torch.testing.assert_close(block @ block.T, torch.eye(16), rtol=0, atol=1e-6)  # float32: measured 2.4e-7


def test_performer_matrix_round_trips_through_the_saved_file(tmp_path):
    """load() must read W from model.safetensors, not redraw it from the seed."""
    model = ARCHITECTURES["hf-bert"]()
    convert(model, "performer", seed=7)
    with torch.no_grad():
        for la in linear_attention_modules(model):
            la.phi_q.random_features.mul_(1.5)  # not what the seed draws
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        expected = logits_of(model, inputs)
    loaded = load(save(model, tmp_path / "model"))
    for la_saved, la_loaded in zip(linear_attention_modules(model), linear_attention_modules(loaded)):
        assert torch.equal(la_loaded.phi_q.random_features, la_saved.phi_q.random_features)
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), expected)


def test_performer_key_stabiliser_ignores_pad_keys():
    """A shift taken over the pads too would cancel in exact arithmetic, but not in float32: pad keys at
    k~ = w_f reach the largest logit any key can have (|w_f|^2 / 2), and against that shift the
    large-norm real keys' features underflow to 0."""
    layer = layer_of("performer").float()
    g = torch.Generator().manual_seed(4)
    q, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(2))
    k = 10 * torch.randn(1, 2, 6, 8, generator=g)  # real logits about -100
    pad_keys = layer.phi_q.random_features[:3] * 8**0.25  # logits |w_f|^2 / 2 > 0
    pad = lambda x: torch.cat([x, torch.randn(1, 2, 3, 8, generator=g)], 2)  # noqa: E731
    mask = torch.tensor([[True] * 6 + [False] * 3])
    with torch.no_grad():
        alone = layer(q, k, v)
        padded = layer(pad(q), torch.cat([k, pad_keys.expand(1, 2, 3, 8)], 2), pad(v), key_mask=mask)
    assert float(alone.abs().max()) > 0.1
    # measured 0 (the same real keys, the same stabiliser)
    torch.testing.assert_close(padded[:, :, :6], alone, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------- cosFormer
def test_cosformer_positions_are_among_real_tokens_in_chunks_too():
    """The streamed path's chunks see their absolute ranks: same output as the plain path."""
    g = torch.Generator().manual_seed(5)
    layer = layer_of("cosformer").float()
    q, k, v = (torch.randn(2, 2, 40, 8, generator=g) for _ in range(3))
    mask = torch.arange(40)[None, :] >= torch.tensor([[0], [13]])  # the second row left-padded
    with torch.no_grad():
        plain = layer(q, k, v, key_mask=mask)
        layer.stream_min_bytes, layer.stream_chunk_bytes = 0, 1  # chunks of 16 tokens
        streamed = layer(q, k, v, key_mask=mask)
    torch.testing.assert_close(streamed, plain, rtol=0, atol=1e-6)  # measured 1.8e-7


def prefix_neutral_attention(q, k, v, prefix, eps):
    """Prefix tokens weigh relu(q).relu(k) with every token; patches i, j (ranked among the patches,
    M = the patch count) relu(q).relu(k) cos(pi (i - j) / 2M)."""
    n = q.shape[2]
    ranks = torch.arange(n, dtype=q.dtype) - prefix
    weight = torch.cos(math.pi * (ranks[:, None] - ranks[None, :]) / (2 * (n - prefix)))
    is_prefix = torch.arange(n) < prefix
    weight = torch.where(is_prefix[:, None] | is_prefix[None, :], torch.ones_like(weight), weight)
    scores = q.clamp_min(0) @ k.clamp_min(0).transpose(-1, -2) * weight
    return (scores / (scores.sum(-1, keepdim=True) + eps)) @ v


@pytest.mark.parametrize("prefix", [1, 3])
def test_cosformer_prefix_tokens_are_position_neutral(prefix):
    g = torch.Generator().manual_seed(6)
    layer = layer_of("cosformer", spatial=True)
    q, k, v = (torch.randn(2, 2, prefix + 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        got = layer(q, k, v, grid=(3, 3), num_prefix=prefix)
        phi_q, phi_k = layer.features(q, k, AttentionContext(None, prefix + 9, prefix, (3, 3)))
        raster = layer_of("cosformer", spatial=True, prefix_neutral=False)(q, k, v, grid=(3, 3), num_prefix=prefix)
    assert phi_q.shape[-1] == phi_k.shape[-1] == 4 * 8  # two more blocks on inputs with prefix tokens
    torch.testing.assert_close(got, prefix_neutral_attention(q, k, v, prefix, layer.eps), rtol=0, atol=1e-14)  # measured 4.4e-16
    assert not torch.allclose(raster, got)  # the option matters


@pytest.mark.parametrize("arch, prefix", [("hf-vit", 1), ("timm-vit-reg", 3), ("hf-bert", 0)])
def test_converted_models_tell_cosformer_their_prefix_tokens(arch, prefix):
    model = ARCHITECTURES[arch]()
    convert(model, "cosformer")  # no DWC branch: the prefix count still reaches the map
    seen = []
    for la in linear_attention_modules(model):
        assert la.dwc is None
        forward, rows = la.phi_q.forward, la.phi_q.feature_rows  # stored features, or made in the products
        la.phi_q.forward = lambda x, context=None, f=forward: seen.append(context.num_prefix) or f(x, context)
        la.phi_q.feature_rows = lambda *xs, context=None, f=rows: seen.append(context.num_prefix) or f(*xs, context=context)
    with torch.no_grad():
        logits_of(model, example_inputs(arch))
    assert seen and set(seen) == {prefix}


def test_performer_kernel_epsilon_trains_with_the_stabilisers_detached():
    """With kernel_epsilon > 0 the stabilisers no longer cancel exactly: the map follows performer-pytorch,
    phi = m^(-1/2) (exp(logits - stop_gradient(c)) + kernel_epsilon), and backward must run through it."""
    g = torch.Generator().manual_seed(3)
    layer = layer_of("performer", kernel_epsilon=1e-3)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    got = layer(q, k, v, key_mask=MASK)
    w, m = layer.phi_q.random_features, layer.phi_q.random_features.shape[0]

    def features(x, per_query):
        xt = x / x.shape[-1] ** 0.25
        logits = xt @ w.T - (xt**2).sum(-1, keepdim=True) / 2
        c = logits.detach().amax(-1, keepdim=True) if per_query else logits.detach().amax()
        return (torch.exp(logits - c) + 1e-3) / math.sqrt(m)

    want = torch.zeros_like(v)
    for b in range(2):
        real = MASK[b].nonzero().flatten()
        for h in range(2):
            fq, fk = features(q[b, h, real], True), features(k[b, h, real], False)
            weights = fq @ fk.T
            want[b, h, real] = (weights / (weights.sum(-1, keepdim=True) + layer.eps)) @ v[b, h, real]
    rows = MASK[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64) * MASK[:, None, :, None]
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
