"""Hedgehog's native feature map (``hedgehog.native_features``: ``ops.products`` and ``ops.exp_rows``' softmax
pair) against its reference, the PyTorch path ``hedgehog.softmax_pair_features`` in float64: values and gradients
for x, W and b, at the heads split from [B, N, H d], over several batches, threads and head sizes, in the
build for this CPU and, where the CPU runs it, in the AVX2 build (8 lanes) that a CPU without AVX-512
gets. Then: logits far apart (exp below float32's range), a float64 default dtype, a layer that takes
the native path and gives the PyTorch path's outputs, and where it does not apply. The exps themselves are
tested in tests/test_exp_rows.py.
"""

from __future__ import annotations

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods import hedgehog
from luna_convert.ops import exp_rows, native


def inputs(b: int, h: int, n: int, d: int, seed: int = 0, spread: float = 1.0):
    """x [B, H, N, d] as the heads split from [B, N, H d] (a strided view), W near I, b, and a gradient."""
    torch.manual_seed(seed)
    x = torch.randn(b, n, h, d).transpose(1, 2) * spread
    weight = torch.eye(d) + 0.3 * torch.randn(h, d, d)
    bias = torch.randn(h, 1, d)
    return x, weight, bias, torch.randn(b, h, n, 2 * d)


def values_and_grads(features, x, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    out = features(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


@pytest.mark.parametrize("b, h, n, d", [(1, 12, 300, 64), (2, 3, 17, 16), (3, 2, 5, 32), (1, 1, 1, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_values_and_gradients_match_the_pytorch_path_in_float64(exp_rows_library, b, h, n, d, threads):
    if d % exp_rows.lanes():
        pytest.skip(f"d = {d} is not a multiple of this build's {exp_rows.lanes()} lanes")
    x, weight, bias, grad = inputs(b, h, n, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert hedgehog.native_applies(x, weight, bias)
        got = values_and_grads(hedgehog.native_features, x, weight, bias, grad)
    finally:
        torch.set_num_threads(before)
    want = values_and_grads(hedgehog.softmax_pair_features, x.double(), weight.double(), bias.double(), grad)
    for name, a, e in zip(["features", "x", "W", "b"], got, want):
        assert a.dtype == torch.float32 and a.shape == e.shape, name
        # measured: 1.3e-6 relative at most on the features (torch's own float32 softmax: 1.3e-6 as well)
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-5, msg=name)


def test_the_avx2_build_takes_head_sizes_of_eight_lanes(exp_rows_library):
    """d = 24: a multiple of 8, not of 16: the AVX2 build computes it, the AVX-512 one leaves it to PyTorch."""
    x, weight, bias, grad = inputs(2, 2, 9, 24)
    if exp_rows.lanes() != 8:
        assert not hedgehog.native_applies(x, weight, bias)
        return
    got = values_and_grads(hedgehog.native_features, x, weight, bias, grad)
    want = values_and_grads(hedgehog.softmax_pair_features, x.double(), weight.double(), bias.double(), grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-5)


def test_logits_far_apart_give_zeros_not_garbage(exp_rows_library):
    """Logits spanning about 400: most exps fall below float32's range (0 there, where torch's are 0 or
    subnormal), the largest of each half is near 1, and each half still sums to 1."""
    x, _, bias, _ = inputs(1, 2, 64, 16, spread=60.0)
    weight = torch.eye(16).repeat(2, 1, 1)
    with torch.no_grad():
        got = hedgehog.native_features(x, weight, bias)
        want = hedgehog.softmax_pair_features(x.double(), weight.double(), bias.double())
    assert torch.isfinite(got).all() and (got == 0).float().mean() > 0.3
    # float32 logits of a few hundred are rounded by ~3e-5, and exp carries that into its relative error
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-37)
    torch.testing.assert_close(got.view(1, 2, 64, 2, 16).sum(-1), torch.ones(1, 2, 64, 2))


def test_outputs_and_gradients_are_float32_whatever_the_default_dtype(exp_rows_library):
    x, weight, bias, grad = inputs(2, 2, 9, 16)
    want = values_and_grads(hedgehog.native_features, x, weight, bias, grad)
    torch.set_default_dtype(torch.float64)
    try:
        got = values_and_grads(hedgehog.native_features, x, weight, bias, grad)
    finally:
        torch.set_default_dtype(torch.float32)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_where_it_does_not_apply():
    x, weight, bias, _ = inputs(1, 2, 8, 16)
    assert not hedgehog.native_applies(x.double(), weight.double(), bias.double())  # float64: PyTorch's path
    assert not hedgehog.native_applies(x[..., :12], weight[:, :12, :12], bias[..., :12])  # not whole vectors
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not hedgehog.native_applies(x, weight, bias)  # the projection in the autocast dtype


def test_a_hedgehog_layer_takes_the_native_path_and_gives_the_pytorch_paths_outputs(monkeypatch):
    if exp_rows.library() is None:
        pytest.skip(exp_rows.status())
    q, k, v = (torch.randn(2, 4, 40, 32, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, -7:] = False
    grad = torch.randn(2, 4, 40, 32)
    calls = []
    spy = hedgehog.native_features
    monkeypatch.setattr(hedgehog, "native_features", lambda *a: calls.append(1) or spy(*a))
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv(native.DISABLE_VARIABLE, setting)
        torch.manual_seed(0)
        layer = LinearAttention("hedgehog", 32, 4, 32**-0.5)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(0.05 * torch.randn_like(p))  # off the identity init
        out = layer(q, k, v, key_mask=key_mask)
        results.append([out.detach(), *torch.autograd.grad(out, [q, k, v, *layer.parameters()], grad)])
    assert len(calls) == 2  # queries and keys with the native path on; none with it off
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
