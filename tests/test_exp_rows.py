"""The native exps of rows (``ops.exp_rows``, ``exp_rows.c``) against their PyTorch references in float64:
the softmax pair and its backward, exp(x - row max - offset) and exp(x - a shift per group), in place, at
widths with and without a partial last vector, over one and two threads, in the build for this CPU and,
where the CPU runs it, in the AVX2 build (8 lanes). Then the exp itself to a few float32 rounding errors,
-inf (pad keys) and NaN as torch treats them, a float64 default dtype, and where the native code does not
apply.
"""

from __future__ import annotations

import pytest
import torch

from luna_convert.ops import exp_rows


def with_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows, d", [(700, 64), (5, 16), (1, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_pair_and_its_backward_match_the_reference(exp_rows_library, rows, d, threads):
    torch.manual_seed(rows)
    z, grad = torch.randn(rows, d) * 3, torch.randn(rows, 2 * d)
    assert exp_rows.applies(z) and d % exp_rows.lanes() == 0
    features = with_threads(threads, lambda: exp_rows.softmax_pair(z))
    want = exp_rows.softmax_pair_reference(z.double())
    torch.testing.assert_close(features.double(), want, rtol=1e-5, atol=1e-7)  # measured 1.3e-6 relative at most
    grad_z = with_threads(threads, lambda: exp_rows.softmax_pair_backward(features, grad))
    # against autograd through the reference, and the reference's own formula
    z64 = z.double().requires_grad_()
    (autograd,) = torch.autograd.grad(exp_rows.softmax_pair_reference(z64), z64, grad.double())
    torch.testing.assert_close(grad_z.double(), autograd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exp_rows.softmax_pair_backward_reference(want, grad.double()), autograd)


@pytest.mark.parametrize("width", [266, 64, 7, 1])  # Performer's m = d ln d at d = 64; whole vectors; a tail only
@pytest.mark.parametrize("threads", [1, 2])
def test_exp_minus_row_max_matches_the_reference(exp_rows_library, width, threads):
    torch.manual_seed(width)
    x = torch.randn(300, width) * 4
    got = with_threads(threads, lambda: exp_rows.exp_minus_row_max_(x.clone(), 2.5))
    torch.testing.assert_close(got, exp_rows.exp_minus_row_max_reference_(x.clone(), 2.5), rtol=3e-6, atol=1e-30)
    # the arguments as float32 forms them, exp in float64: what is left is exp's own error (2.3 units of 2^-24)
    want = torch.exp((x - (x.amax(-1, keepdim=True) + 2.5)).double())
    torch.testing.assert_close(got.double(), want, rtol=3 * 2**-24, atol=1e-37)


@pytest.mark.parametrize("width", [266, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_exp_minus_shift_takes_one_shift_per_group(exp_rows_library, width, threads):
    torch.manual_seed(width)
    x = torch.randn(6, 50, width) * 4
    x[2, 10:] = float("-inf")  # pad keys: exact zeros
    shift = x.amax(dim=(1, 2)) + 1.0
    got = with_threads(threads, lambda: exp_rows.exp_minus_shift_(x.clone(), shift))
    torch.testing.assert_close(got, exp_rows.exp_minus_shift_reference_(x.clone(), shift), rtol=3e-6, atol=1e-30)
    want = torch.exp((x - shift[:, None, None]).double())  # float32 arguments, exp in float64
    torch.testing.assert_close(got.double(), want, rtol=3 * 2**-24, atol=1e-37)
    assert (got[2, 10:] == 0).all()


def test_exp_is_within_a_few_float32_rounding_errors(exp_rows_library):
    """Rows [0, r_1 .. r_15]: the softmax's i-th value over its first is exp(r_i) (the first is exp(0) = 1
    exactly), rounded once more by the scaling. Measured: 2.3 units of 2^-24 at most; with one Taylor
    coefficient off by 3 % (1/700 for 1/720) 3.6."""
    torch.manual_seed(0)
    r = -torch.rand(40000, 15) * 87
    y = exp_rows.softmax_pair(torch.cat([torch.zeros(40000, 1), r], -1)).double()[:, :16]
    want = torch.exp(r.double())
    assert ((y[:, 1:] / y[:, :1] - want).abs() / want).max() < 3 * 2**-24


def test_arguments_below_floats_range_give_zero(exp_rows_library):
    x = torch.tensor([[0.0, -80.0, -87.0, -88.0, -100.0, -1e30, float("-inf")]])
    got = exp_rows.exp_minus_row_max_(x.clone())
    assert got[0, 0] == 1 and got[0, 1] > 0 and (got[0, 3:] == 0).all()
    torch.testing.assert_close(got[0, :3].double(), torch.exp(x[0, :3].double()), rtol=1e-6, atol=0)


@pytest.mark.parametrize("where", [0, 5, 15])
def test_a_nan_makes_its_row_nan_as_in_torch(exp_rows_library, where):
    z = torch.randn(4, 16)
    z[2, where] = float("nan")
    for got, want in [(exp_rows.softmax_pair(z), exp_rows.softmax_pair_reference(z)),
                      (exp_rows.exp_minus_row_max_(z.clone()), exp_rows.exp_minus_row_max_reference_(z.clone()))]:
        assert got[2].isnan().all() and want[2].isnan().all()
        assert torch.isfinite(got[[0, 1, 3]]).all()


def test_outputs_are_float32_whatever_the_default_dtype(exp_rows_library):
    z, grad = torch.randn(9, 16), torch.randn(9, 32)
    want = exp_rows.softmax_pair(z), exp_rows.softmax_pair_backward(exp_rows.softmax_pair(z), grad)
    torch.set_default_dtype(torch.float64)
    try:
        got = exp_rows.softmax_pair(z), exp_rows.softmax_pair_backward(exp_rows.softmax_pair(z), grad)
    finally:
        torch.set_default_dtype(torch.float32)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_where_the_native_code_does_not_apply_the_reference_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(exp_rows, "library", lambda: calls.append(1))  # would fail if the native code were used
    z = torch.randn(3, 16)
    assert not exp_rows.applies(z.double()) and not exp_rows.applies(z.t())  # float64; not contiguous
    torch.testing.assert_close(exp_rows.softmax_pair(z.double()), exp_rows.softmax_pair_reference(z.double()))
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(exp_rows.exp_minus_shift_(x.clone(), torch.zeros(2, dtype=torch.float64)), x.exp())
    with pytest.raises(RuntimeError):  # a shift per group or nothing: the reference says what does not match
        exp_rows.exp_minus_shift_(torch.randn(2, 3, 5), torch.zeros(3))


@pytest.mark.parametrize("method", ["performer", "flexformer"])
def test_positive_random_feature_layers_take_the_native_exps_and_give_the_pytorch_paths_outputs(method, monkeypatch):
    """Values and gradients (q, k, v and Flexformer's frequencies) with the native exps and with the PyTorch path
    (``LUNA_CONVERT_NATIVE=0``), a padded batch: the keys' per-example stabiliser, the pads' zeros, and an
    example without a real key."""
    from luna_convert.layers.attention import LinearAttention
    from luna_convert.ops import native

    if exp_rows.library() is None:
        pytest.skip(exp_rows.status())
    q, k, v = (torch.randn(3, 4, 40, 16, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(3, 40, dtype=torch.bool)
    key_mask[1, -7:] = False
    key_mask[2] = False  # no real key at all: its stabiliser is 0, its features and outputs 0
    grad = torch.randn(3, 4, 40, 16)
    calls = {"row max": 0, "shift": 0}
    row_max, shift = exp_rows.exp_minus_row_max_, exp_rows.exp_minus_shift_
    monkeypatch.setattr(exp_rows, "exp_minus_row_max_",
                        lambda *a: calls.__setitem__("row max", calls["row max"] + 1) or row_max(*a))
    monkeypatch.setattr(exp_rows, "exp_minus_shift_", lambda *a: calls.__setitem__("shift", calls["shift"] + 1) or shift(*a))
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv(native.DISABLE_VARIABLE, setting)
        torch.manual_seed(0)
        layer = LinearAttention(method, 16, 4, 0.25)
        out = layer(q, k, v, key_mask=key_mask)
        assert torch.isfinite(out).all() and (out[2] == 0).all()
        params = [p for p in layer.parameters() if p.requires_grad]
        results.append([out.detach(), *torch.autograd.grad(out, [q, k, v, *params], grad)])
    assert calls == {"row max": 1, "shift": 1}  # queries and keys with the native code on; none with it off
    assert len(results[0]) == (5 if method == "flexformer" else 4)
    for a, b in zip(*results):  # float32 both, exps rounded apart: measured 1.8e-6 at most (frequencies' up to 0.26)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5 * float(b.abs().max()))
