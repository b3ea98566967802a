"""ELA's three kernels: the layer's output against the explicit N x N kernel written out here (float64),
gradients, padding, the exp stabiliser and the guard of the signed squared-distance features."""

from __future__ import annotations

import pytest
import torch

from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods.ela import KERNELS


def explicit_kernel(kernel: str, q: torch.Tensor, k: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """[B, H, N, N]: sum_d exp(q_d/tau) exp(k_d/tau), ||q + k||^2 or ||q - k||^2 (tau [H, 1, 1])."""
    if kernel == "exp":
        return torch.einsum("bhnd,bhmd->bhnm", torch.exp(q / tau), torch.exp(k / tau))
    sign = 1 if kernel == "l2sum" else -1
    return ((q[:, :, :, None, :] + sign * k[:, :, None, :, :]) ** 2).sum(-1)


def layer_for(kernel: str) -> LinearAttention:
    torch.manual_seed(0)
    layer = LinearAttention("ela", 5, 2, 5**-0.5, kernel=kernel).double()
    if layer.phi_q.log_temperature is not None:
        with torch.no_grad():
            layer.phi_q.log_temperature.copy_(torch.tensor([0.3, -0.4]).view(2, 1, 1))
    return layer


def temperature(layer):
    lt = layer.phi_q.log_temperature
    return torch.ones(1, dtype=torch.float64) if lt is None else torch.exp(lt.detach())


@pytest.mark.parametrize("kernel", KERNELS)
def test_output_equals_the_explicit_kernel(kernel):
    layer = layer_for(kernel)
    g = torch.Generator().manual_seed(1)
    q, k, v = (2 * torch.randn(2, 2, 7, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    kern = explicit_kernel(kernel, q, k, temperature(layer)) * mask[:, None, None, :]
    want = kern @ v / kern.sum(-1, keepdim=True)
    with torch.no_grad():
        got = layer(q, k, v, mask)
        weights = layer.attention_weights(q, k, mask)
    # measured 1.6e-11 (exp: the 1e-12 guard over shifted row sums), 1.1e-15 (squared distances)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(weights @ v, want, rtol=0, atol=1e-10)  # the same


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradcheck_and_padding(kernel):
    layer = layer_for(kernel)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True] * 4 + [False] * 2])
    params = list(layer.parameters())
    assert torch.autograd.gradcheck(lambda q_, k_, v_, *p: layer(q_, k_, v_, mask), (q, k, v, *params))
    with torch.no_grad():  # pads of any size change no real row
        noisy = lambda x: torch.where(mask[:, None, :, None], x, 40 * torch.randn(x.shape, generator=g,  # noqa: E731
                                                                                   dtype=x.dtype))
        torch.testing.assert_close(layer(noisy(q), noisy(k), noisy(v), mask)[:, :, :4],
                                   layer(q[:, :, :4], k[:, :, :4], v[:, :, :4]), rtol=0, atol=1e-12)  # measured 0


def test_exp_stabiliser_keeps_large_keys_finite_and_changes_nothing():
    """exp(1000) overflows even float64; a constant added to every query or key coordinate cancels in the rows."""
    layer = layer_for("exp")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 5, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        out = layer(q, k, v)
        shifted = layer(q + 1000.0, k + 1500.0, v)
        shifted32 = layer.float()(q.float() + 150.0, k.float() + 200.0, v.float())
    assert bool(torch.isfinite(shifted).all()) and bool(torch.isfinite(shifted32).all())
    torch.testing.assert_close(shifted, out, rtol=0, atol=1e-9)  # measured 1.5e-13 (the shifted inputs' rounding)


def test_squared_distance_rows_with_zero_kernel_are_finite():
    """||q - k||^2 with q = k = 0 for the only key: every kernel value is exactly 0, so is the output (no 0/0)."""
    layer = layer_for("l2sub")
    assert layer.divisor.clamp
    zeros = torch.zeros(1, 2, 1, 5, dtype=torch.float64)
    v = torch.randn(1, 2, 1, 5, dtype=torch.float64)
    out = layer(zeros, zeros, v)
    assert torch.equal(out, torch.zeros_like(out))
