"""The sliding-window softmax + linear attention hybrid (the ``window`` option): the block-banded op
against the explicit N x N reference (values and gradients), the reference against the formula written
out entry by entry, the window's edges, w >= N as exact softmax, window 0 unchanged, validation,
save + load, and attention distillation through the hybrid."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from luna_convert.conversion import convert, feature_map_parameters, linear_attention_modules, resolve_options
from luna_convert.errors import ConversionError
from luna_convert.layers.attention import AttentionMode, LinearAttention
from luna_convert.linear_methods import METHODS
from luna_convert.linear_methods.base import FEATURE_MAP_KIND
from luna_convert.ops.context import AttentionContext
from luna_convert.ops.linear import linear_attention
from luna_convert.ops.reference import linear_attention_weights, softmax_attention
from luna_convert.ops.windowed import windowed_linear_attention
from luna_convert.serialization import CONVERSION_FILE, load, save

from conftest import HEADS, LAYERS, example_inputs, logits_of, make_bert

METHODS_UNDER_TEST = ["hedgehog", "luna", "t2r"]
KERNEL_METHODS = sorted(name for name, spec in METHODS.items() if spec.kind != FEATURE_MAP_KIND)
N, D, H = 13, 8, 3  # 13 tokens: not a multiple of the block size for w = 3 or 5


def make_layer(name: str, window: int, seed: int = 0, dtype=torch.float64) -> LinearAttention:
    """A layer with the hybrid on, its maps at their seeded init and gamma different in every head."""
    torch.manual_seed(seed)
    layer = LinearAttention(name, D, H, D**-0.5, window=window, dwc=False).to(dtype)
    if layer.window_mix is not None:
        with torch.no_grad():
            layer.window_mix.copy_(torch.tensor([-1.0, 0.3, 1.5][:H]))
    return layer


def inputs(seed: int = 1, dtype=torch.float64, batch: int = 2):
    """q, k, v [B, H, N, D] and a key mask: the first example has 4 pads at the end."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, H, N, D, generator=g, dtype=dtype) for _ in range(3))
    key_mask = torch.ones(batch, N, dtype=torch.bool)
    key_mask[0, N - 4:] = False
    return q, k, v, key_mask


def explicit_hybrid(layer: LinearAttention, q, k, v, key_mask):
    """The formula entry by entry, in plain Python loops over batch, head, query and key (independent of
    the library's tensor code): (normalised weights [B, H, N, N], outputs [B, H, N, d])."""
    phi_q, phi_k = layer.features(q, k, AttentionContext(key_mask, N))
    gamma = layer.window_gamma()
    b_size, heads, n, _ = q.shape
    weights = torch.zeros(b_size, heads, n, n, dtype=torch.float64)
    for b in range(b_size):
        real = [j for j in range(n) if key_mask[b, j]]
        for h in range(heads):
            for i in range(n):
                window = [j for j in real if abs(i - j) <= layer.window]
                scores = {j: layer.softmax_scale * float(q[b, h, i] @ k[b, h, j]) for j in real}
                c = max((scores[j] for j in window), default=0.0)
                for j in real:
                    weights[b, h, i, j] = (math.exp(scores[j] - c) if j in window
                                           else float(gamma[h]) * float(phi_q[b, h, i] @ phi_k[b, h, j]))
    weights = weights / (weights.sum(-1, keepdim=True) + layer.eps)
    return weights, weights @ v.double()


# ----------------------------------------------------------------- the reference is the formula
@pytest.mark.parametrize("name", METHODS_UNDER_TEST)
@pytest.mark.parametrize("window", [1, 3])
def test_reference_is_the_formula_entry_by_entry(name, window):
    layer = make_layer(name, window)
    q, k, v, key_mask = inputs()
    with torch.no_grad():
        got = layer.attention_weights(q, k, key_mask, AttentionContext(key_mask, N))
        want, _ = explicit_hybrid(layer, q, k, v, key_mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("window", [1, 3])
def test_the_window_edge_is_exact_softmax_and_one_step_beyond_is_linear(window):
    """a_ij at |i - j| = w is exp(s_ij - c_i), at |i - j| = w + 1 it is gamma phi(q_i).phi(k_j): checked on both
    sides of the diagonal, for the reference and (through its rows times one-hot values) for the fast op."""
    layer = make_layer("hedgehog", window)
    q, k, _, _ = inputs()
    q, k = q[:1], k[:1]
    context = AttentionContext(None, N)
    eye = torch.eye(N, dtype=torch.float64).expand(1, H, N, N)  # v = I: the output rows are the weight rows
    with torch.no_grad():
        phi_q, phi_k = layer.features(q, k, context)
        scores = layer.softmax_scale * q @ k.transpose(-1, -2)
        kernel = phi_q @ phi_k.transpose(-1, -2)
        gamma = layer.window_gamma()
        reference = layer.attention_weights(q, k, None, context)
        fast = windowed_linear_attention(q, k, eye, phi_q, phi_k, gamma, window, layer.softmax_scale, None, layer.eps)
    i = N // 2
    for h in range(H):
        c = max(float(scores[0, h, i, j]) for j in range(i - window, i + window + 1))
        inside = {j: math.exp(float(scores[0, h, i, j]) - c) for j in range(i - window, i + window + 1)}
        beyond = {j: float(gamma[h] * kernel[0, h, i, j]) for j in range(N) if j not in inside}
        total = sum(inside.values()) + sum(beyond.values())
        edges = {i - window: inside[i - window], i + window: inside[i + window],
                 i - window - 1: beyond[i - window - 1], i + window + 1: beyond[i + window + 1]}
        for weights in (reference, fast):
            row = weights[0, h, i] / weights[0, h, i].sum()  # a_ij / sum_j a_ij (eps divides out)
            for j, a in edges.items():
                assert float(row[j]) == pytest.approx(a / total, rel=1e-10), (h, i, j)


# ----------------------------------------------------------------- the fast op against the reference
@pytest.mark.parametrize("name", METHODS_UNDER_TEST)
@pytest.mark.parametrize("window", [1, 3, 5, N, N + 7])
def test_fast_op_equals_reference_values_and_gradients(name, window):
    layer = make_layer(name, window)
    q, k, v, key_mask = inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    context = AttentionContext(key_mask, N)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    wrt = (q, k, v, layer.window_mix)

    fast = layer.linear_output(q, k, v, key_mask, context)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), wrt)
    reference = layer.attention_weights(q, k, key_mask, context) @ v
    reference_grads = torch.autograd.grad((reference * upstream).sum(), wrt)

    torch.testing.assert_close(fast, reference, atol=1e-12, rtol=1e-10)
    for label, got, want in zip(("q", "k", "v", "window_mix"), fast_grads, reference_grads):
        # the gradient is really there (gamma's only where some pair lies beyond the window)
        assert bool(want.abs().sum() > 0) or (label == "window_mix" and window >= N - 1), label
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-9, msg=label)


@pytest.mark.parametrize("name", METHODS_UNDER_TEST)
@pytest.mark.parametrize("window", [N - 1, N, N + 7])
def test_a_window_covering_the_sequence_is_exact_softmax_attention(name, window):
    layer = make_layer(name, window)  # every pair has |i - j| <= N - 1: no linear part left
    q, k, v, key_mask = inputs()
    with torch.no_grad():
        got = layer(q, k, v, key_mask)
    want = softmax_attention(q, k, v, layer.softmax_scale, key_mask)  # torch's SDPA
    # den = sum of exp(s - max) >= 1, so eps changes a row by at most 1e-6 relative
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and one less: the two farthest pairs become linear terms, so it is no longer softmax
    shorter = make_layer(name, N - 2)
    with torch.no_grad():
        assert not torch.allclose(shorter(q, k, v, key_mask), want, atol=1e-4)


@pytest.mark.parametrize("name", ["hedgehog", "taylor"])
def test_half_precision_accumulates_in_float32(name):
    layer = make_layer(name, 2, dtype=torch.float32)
    q, k, v, key_mask = inputs(dtype=torch.float32)
    context = AttentionContext(key_mask, N)
    with torch.no_grad():
        want = layer.attention_weights(q, k, key_mask, context).double() @ v.double()
        half = [t.bfloat16() for t in (q, k, v)]
        phi_q, phi_k = (f.bfloat16() for f in layer.features(q, k, context))  # as autocast would hand them over
        got = windowed_linear_attention(*half, phi_q, phi_k, layer.window_gamma(), 2, layer.softmax_scale,
                                        key_mask, layer.eps, layer.divisor.clamp)
    assert got.dtype == torch.bfloat16
    # the sums ran in float32: the same as the float32 op on the same (rounded) inputs, rounded once at the end
    upcast = windowed_linear_attention(*(t.float() for t in (*half, phi_q, phi_k)), layer.window_gamma(), 2,
                                       layer.softmax_scale, key_mask, layer.eps, layer.divisor.clamp)
    assert torch.equal(got, upcast.bfloat16())
    torch.testing.assert_close(got.double(), want, atol=0.06, rtol=0.05)  # bf16 inputs: ~3 significant digits


class LargestTensor(TorchFunctionMode):
    """Records the largest tensor any torch function returns inside the block."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_fast_op_never_builds_anything_quadratic_in_n():
    n, window = 512, 2
    layer = LinearAttention("hedgehog", D, 1, D**-0.5, window=window, dwc=False)
    q, k, v = (torch.randn(1, 1, n, D) for _ in range(3))
    with torch.no_grad(), LargestTensor() as largest:
        layer(q, k, v)
    # the largest are hedgehog's neighbour key features [N / w, 3 w, 2 d] = 48 N; N x N would be 512 N
    assert largest.numel <= 64 * n, largest.numel


# ----------------------------------------------------------------- window 0, validation
@pytest.mark.parametrize("name", sorted(name for name, spec in METHODS.items() if spec.kind == FEATURE_MAP_KIND))
def test_window_zero_leaves_the_layer_as_it_was(name):
    torch.manual_seed(0)
    layer = LinearAttention(name, D, H, D**-0.5, dwc=False).eval()
    assert layer.window == 0 and layer.window_mix is None
    assert not any("window" in key for key in layer.state_dict())
    q, k, v, key_mask = (t.float() if t.is_floating_point() else t for t in inputs())
    context = AttentionContext(key_mask, N)
    with torch.no_grad():
        features = layer.features(q, k, context)
        out = layer(q, k, v, key_mask)
        expected = linear_attention(*features, v, key_mask, layer.eps, layer.divisor.clamp)
        if name in ("taylor", "llops", "t2r", "t2r-hh", "elu", "performer", "flexformer"):
            # their layers make the features inside the native products (tests/test_produced_rows.py), which sum
            # in another order than torch.bmm does over Taylor's stored, feature-major features, and whose
            # makers round the others' features otherwise (projections, exps)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(out, expected)
        assert torch.equal(layer.attention_weights(q, k, key_mask, context),
                           linear_attention_weights(*features, key_mask, layer.eps, layer.divisor.clamp))


@pytest.mark.parametrize("name", KERNEL_METHODS)
def test_kernel_methods_refuse_a_window(name):
    message = "only feature-map methods support a sliding window"
    with pytest.raises(ValueError, match=message):
        METHODS[name].make_options(window=2)
    with pytest.raises(ValueError, match=message):
        LinearAttention(name, D, H, D**-0.5, window=2)
    with pytest.raises(ConversionError, match=message):
        convert(make_bert(), name, window=2)
    assert METHODS[name].make_options(window=0).window == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_bad_window_values_are_refused(bad):
    with pytest.raises(ValueError, match="window must be a non-negative integer"):
        METHODS["hedgehog"].make_options(window=bad)
    with pytest.raises(ConversionError, match="invalid options for method 'hedgehog'.*window must be"):
        resolve_options("hedgehog", {"window": bad})


# ----------------------------------------------------------------- conversion, save + load, distillation
def test_convert_save_load_round_trip_keeps_the_hybrid(tmp_path):
    plain = convert(make_bert(), "hedgehog")
    model = make_bert()
    report = convert(model, "hedgehog", window=2)
    assert report.options.window == 2
    assert report.params_added == plain.params_added + LAYERS * HEADS  # one gamma per head and layer
    g = torch.Generator().manual_seed(3)
    for layer in linear_attention_modules(model):
        assert layer.window == 2 and torch.equal(layer.window_mix, torch.zeros(HEADS))  # gamma = 1/2
        assert any(p is layer.window_mix for p in feature_map_parameters(model))
        with torch.no_grad():  # values a fresh conversion would not give: loading must read them
            for param in layer.parameters():
                param.add_(0.3 * torch.randn(param.shape, generator=g))
    batch = example_inputs("hf-bert")
    with torch.no_grad():
        expected = logits_of(model, batch)
    loaded = load(save(model, tmp_path / "model"))
    assert getattr(loaded, "linear_attention_config").options.window == 2
    for before, after in zip(linear_attention_modules(model), linear_attention_modules(loaded)):
        assert torch.equal(before.window_mix, after.window_mix)
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, batch), expected)


def test_a_folder_saved_before_the_window_existed_loads_with_window_zero(tmp_path):
    model = make_bert()
    convert(model, "hedgehog")
    folder = save(model, tmp_path / "model")
    meta = json.loads((folder / CONVERSION_FILE).read_text())
    del meta["conversion"]["options"]["window"]
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    loaded = load(folder)
    assert getattr(loaded, "linear_attention_config").options.window == 0
    assert all(layer.window_mix is None for layer in linear_attention_modules(loaded))


@pytest.mark.parametrize("name", METHODS_UNDER_TEST)
def test_attention_distillation_trains_the_mixing_factor(name):
    layer = make_layer(name, 2, dtype=torch.float32)
    layer.set_mode(AttentionMode.DISTILL_ATTENTION)
    assert any(p is layer.window_mix for p in layer.method_parameters())
    q, k, v, key_mask = (t.float() if t.is_floating_point() else t for t in inputs())
    out = layer(q, k, v, key_mask)
    torch.testing.assert_close(out, softmax_attention(q, k, v, layer.softmax_scale, key_mask))  # the teacher's output
    loss = layer.distill_loss
    assert loss is not None and bool(torch.isfinite(loss))
    (grad,) = torch.autograd.grad(loss, layer.window_mix)
    assert bool(torch.isfinite(grad).all()) and bool((grad != 0).all())


def test_the_mixing_factor_starts_at_one_unbounded_and_trains_faster():
    """gamma = exp(window_mix): 1 at conversion, any positive value reachable; window_mix at
    WINDOW_MIX_LR_SCALE x the rate in both stages' optimizer groups (a sigmoid gate at the maps' rate
    barely moved: docs/quality.md section 10)."""
    from luna_convert.engine.training import scaled_groups
    from luna_convert.layers.attention import WINDOW_MIX_LR_SCALE

    layer = LinearAttention("hedgehog", D, H, D**-0.5, window=2, dwc=False)
    torch.testing.assert_close(layer.window_gamma(), torch.ones(H))
    with torch.no_grad():
        layer.window_mix.fill_(3.0)
    assert torch.allclose(layer.window_gamma(), torch.full((H,), math.exp(3.0)))
    groups = scaled_groups(layer.method_parameters(), [layer], lr=1e-2)
    mix_group = next(g for g in groups if any(p is layer.window_mix for p in g["params"]))
    assert mix_group["lr"] == pytest.approx(1e-2 * WINDOW_MIX_LR_SCALE) and WINDOW_MIX_LR_SCALE > 1
    assert all(g["lr"] == pytest.approx(1e-2) for g in groups if g is not mix_group)
