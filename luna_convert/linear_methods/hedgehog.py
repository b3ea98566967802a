"""Hedgehog: Zhang et al. 2024, "The Hedgehog & the Porcupine: Expressive Linear Attentions with
Softmax Mimicry" (ICLR).

phi(x) = [softmax(W x + b), softmax(-(W x + b))] per head, W = I at init, separate maps for q
and k; trained first to mimic softmax attention (distillation), then finetuned.

The map's parts: here its PyTorch path (``softmax_pair_features``, any dtype and device, the reference), its
native path (``native_features``: float32 on the CPU, the projection in ``ops.products``' native code and the
pair of softmaxes as one pass, ``ops.exp_rows.softmax_pair``, each with a backward of the same kind) and its
made rows (``feature_rows``). The C of the softmax pair and of its made rows is in ``ops/exp_rows.c``, checked
against ``ops.exp_rows.softmax_pair_reference``. The PyTorch path makes five passes over the features after
the projection (two softmaxes, the negation between them, the cat) and its backward as many again; the native
pair reads z = W x + b once and writes both halves, and its backward is one pass from the saved features and
their gradient to z's. Compiled and exported graphs call the registered operators (``luna_convert::product``,
``luna_convert::softmax_pair``, each with its autograd).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import exp_rows, products
from ..ops.context import AttentionContext
from ..ops.products import ProducedRows
from .base import AttentionOptions, FeatureMap, Method
from .registry import register


class HedgehogFeatureMap(FeatureMap):
    """Two separate softmaxes over d (not one over 2d); one Linear(d, d) per head. Natively where
    ``native_applies`` (float32 on the CPU), else ``softmax_pair_features``."""

    options_class = AttentionOptions  # no options of its own
    shared_qk = False
    context_free = True

    def __init__(self, head_dim: int, num_heads: int, options: AttentionOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1))  # [H, d, d]
        self.bias = nn.Parameter(torch.zeros(num_heads, 1, head_dim))

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim

    def feature_rows(self, *xs: torch.Tensor,
                     context: AttentionContext | None = None) -> tuple[ProducedRows, ...] | None:
        """The features of each of ``xs`` made inside the core's native products, never stored: the logits
        (``ops.products.affine_feature_rows``, one W per head) and their softmax pair
        (``ops.exp_rows.softmax_pair_rows``), the same values to the bit as ``forward``'s native path. At
        inference, where that path applies."""
        if not (products.produced_rows_apply(*xs, *self.parameters())
                and all(native_applies(x, self.weight, self.bias) for x in xs)):
            return None
        weight_t, bias = self.weight.transpose(1, 2).contiguous(), self.bias[:, 0]  # [H, d, d], [H, d]
        return tuple(exp_rows.softmax_pair_rows(products.affine_feature_rows(x, weight_t, bias, relu=False))
                     for x in xs)

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        if native_applies(x, self.weight, self.bias):
            return native_features(x, self.weight, self.bias)
        return softmax_pair_features(x, self.weight, self.bias)


def softmax_pair_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[softmax(z), softmax(-z)] with z = x W_h^T + b_h, for x [B, H, N, d], weight [H, d, d], bias [H, 1, d]: the
    PyTorch path (any dtype and device) and the reference of ``native_features``."""
    b, h, n, d = x.shape
    # W_h x + b_h for all heads in one baddbmm (bias fused), head-major: [H, B*N, d] is a view of the heads
    # split from [B, N, H*d] and for B = 1 the result is in [B, H, N, d] order as it stands (the 4-D einsum
    # made about ten calls around its product: permutes, views, a copy of x, the bias add).
    z = torch.baddbmm(bias, x.transpose(0, 1).reshape(h, b * n, d), weight.transpose(1, 2))
    z = z.view(h, b, n, d).transpose(0, 1)
    return exp_rows.softmax_pair_reference(z)


# ---------------------------------------------------------------- the native path
def native_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether the native path takes these: float32 CPU tensors without autocast (under autocast the PyTorch path
    computes the projection in the autocast dtype), x [B, H, N, d] with unit feature stride, d a multiple of
    ``exp_rows.lanes()``, the library built."""
    if torch.is_autocast_enabled("cpu"):
        return False
    width = exp_rows.lanes()
    return (width > 0 and x.dim() == 4 and x.shape[-1] % width == 0 and x.stride(-1) == 1
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, weight, bias)))


class _NativeFeatures(torch.autograd.Function):
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


def native_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[softmax(x W_h^T + b_h), softmax(-(x W_h^T + b_h))] for x [B, H, N, d], weight [H, d, d], bias [H, 1, d]
    (``native_applies``): [B, H, N, 2 d], contiguous, with gradients for all three where autograd records them.
    In a compiled graph the projection and the pair are the operators, whose autograd gives the same gradients."""
    if torch.compiler.is_compiling():
        b, h, _, d = x.shape
        weight_t = weight.transpose(1, 2).contiguous().expand(b, h, d, d)
        bias = bias.expand(b, h, 1, d)
        z = (torch.ops.luna_convert.product(x, weight_t, bias) if products.native_available()
             else products.product_reference(x, weight_t, bias))
        return exp_rows.softmax_pair(z)
    return _NativeFeatures.apply(x, weight, bias)


HEDGEHOG = register(Method(
    name="hedgehog", core=HedgehogFeatureMap, distill=True,
    description="Hedgehog: [softmax(Wx+b), softmax(-(Wx+b))] per head, W=I; distil, then finetune (Zhang et al. 2024)",
    paper="Zhang et al. 2024, The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax Mimicry (ICLR)",
    details="""Confirmed (paper): phi(x) = [softmax(Wx + b), softmax(-(Wx + b))], one trainable Linear(d, d) per
head, separate for q and k, W initialised to the identity; stage 1 distils each attention row with the
cross-entropy -sum_j a_ij log a^_ij against softmax (whole model frozen but the maps), stage 2 finetunes.
Chosen among public variants: two separate softmaxes over d (not one over 2d with a factor 2, not raw
exp). Derived: padded batches (pad keys masked in the teacher, phi(k) zeroed at pads, pad query rows
dropped); the GLUE and ViT stage-1 settings are unconfirmed.""",
))
