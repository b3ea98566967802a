"""Hedgehog's feature map natively, float32 on the CPU: its projection as ``ops.products.product`` and its pair
of softmaxes as one pass (``ops.exp_rows.softmax_pair``), with a backward of the same kind.

The PyTorch path (``hedgehog.softmax_pair_features``, the reference) makes five passes over the features after
the projection (two softmaxes, the negation between them, the cat) and its backward as many again. Here
the softmaxes are one pass that reads z = W x + b once and writes both halves, and the backward one
pass from the saved features and their gradient to z's; the projection and its two gradient products run
in ``ops.products``' native code where it applies (``torch.bmm`` elsewhere).

Used by ``HedgehogFeatureMap.forward`` where ``applies``: float32 on the CPU without autocast, a head size that
is a multiple of ``ops.exp_rows.lanes()``, the library built. Compiled and exported graphs call the registered
operators instead (``luna_convert::product``, ``luna_convert::softmax_pair``, each with its autograd).
Everywhere else, and as the reference in tests/test_hedgehog_native.py, the PyTorch path runs.
"""

from __future__ import annotations

import torch

from ..ops import exp_rows, products


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether the native path takes these: float32 CPU tensors without autocast (under autocast the PyTorch path
    computes the projection in the autocast dtype), x [B, H, N, d] with unit feature stride, d a multiple of
    ``exp_rows.lanes()``, the library built."""
    if torch.is_autocast_enabled("cpu"):
        return False
    width = exp_rows.lanes()
    return (width > 0 and x.dim() == 4 and x.shape[-1] % width == 0 and x.stride(-1) == 1
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, weight, bias)))


class _HedgehogFeatures(torch.autograd.Function):
    """phi(x) = [softmax(z), softmax(-z)], z = x W^T + b per head; saves x, W and phi(x) for the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        b, h, _, d = x.shape
        # W^T made contiguous once, then expanded over the batch (read in place, stride 0): expanding the
        # transposed view would have the product copy it for every example
        weight_t = weight.transpose(1, 2).contiguous().expand(b, h, d, d)
        z = products.product(x, weight_t, bias.expand(b, h, 1, d))
        features = exp_rows.softmax_pair(z)
        ctx.save_for_backward(x, weight, features)
        return features

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_features):
        x, weight, features = ctx.saved_tensors
        b, h, _, d = x.shape
        grad_z = exp_rows.softmax_pair_backward(features, grad_features)
        need_x, need_weight, need_bias = ctx.needs_input_grad
        grad_x = products.product(grad_z, weight.expand(b, h, d, d)) if need_x else None
        grad_weight = grad_bias = None
        if need_weight or need_bias:
            # [grad_z^T x | grad_z summed over tokens]: W's gradient and b's in one product, summed over the batch
            sums = products.transposed_product(grad_z, x, with_sum=True).sum(0)  # [H, d, d + 1]
            grad_weight = sums[..., :d] if need_weight else None
            grad_bias = sums[..., d:].transpose(1, 2) if need_bias else None
        return grad_x, grad_weight, grad_bias


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[softmax(x W_h^T + b_h), softmax(-(x W_h^T + b_h))] for x [B, H, N, d], weight [H, d, d], bias [H, 1, d]
    (``applies``): [B, H, N, 2 d], contiguous, with gradients for all three where autograd records them. In a
    compiled graph the projection and the pair are the operators, whose autograd gives the same gradients."""
    if torch.compiler.is_compiling():
        b, h, _, d = x.shape
        weight_t = weight.transpose(1, 2).contiguous().expand(b, h, d, d)
        bias = bias.expand(b, h, 1, d)
        z = (torch.ops.luna_convert.product(x, weight_t, bias) if products.native_available()
             else products.product_reference(x, weight_t, bias))
        return exp_rows.softmax_pair(z)
    return _HedgehogFeatures.apply(x, weight, bias)
