"""Hedgehog's feature map natively, float32 on the CPU: its projection as ``ops.products.product``, its pair of
softmaxes as one pass (``hedgehog_softmax.c``), and a backward of the same kind.

The PyTorch path (``hedgehog.softmax_pair_features``, the reference) makes five passes over the features after
the projection (two softmaxes, the negation between them, the cat) and its backward as many again. Here
the softmaxes are one pass that reads z = W x + b once and writes both halves, and the backward one
pass from the saved features and their gradient to z's; the projection and its two gradient products run
in ``ops.products``' native code where it applies (``torch.bmm`` elsewhere).

Used by ``HedgehogFeatureMap.forward`` where ``applies``: float32 on the CPU, outside ``torch.compile``, a
head size that is a multiple of the library's vector width (``lanes``), and ``ops.native`` built the
library. Everywhere else, and as the reference in tests/test_hedgehog_native.py, the PyTorch path runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..ops import native, products

SOURCE = Path(__file__).with_name("hedgehog_softmax.c")
# Rows (tokens x heads) per thread chunk at the least: below that a hand-off costs more than the work.
MIN_ROWS_PER_CHUNK = 256
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {"hedgehog_softmax_forward": [_P, _I64, _I64, _I32, _P],
               "hedgehog_softmax_backward": [_P, _P, _I64, _I64, _I32, _P]}


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``ops.native.unavailable_reason(SOURCE)`` says why)."""
    return native.load_library(SOURCE, _SIGNATURES)


def status() -> str:
    """"on", or "off: <why>" (what the bench records beside its timings)."""
    return native.status(SOURCE, _SIGNATURES)


def lanes() -> int:
    """Floats per vector in the built library (8 or 16): the head size must be a multiple of it; 0 without one."""
    lib = library()
    return 0 if lib is None else lib.hedgehog_softmax_lanes()


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether the native path takes these: float32 CPU tensors, eager code without autocast (under autocast the
    PyTorch path computes the projection in the autocast dtype), x [B, H, N, d] with unit feature stride, d a
    multiple of ``lanes()``, the library built."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu"):
        return False
    width = lanes()
    return (width > 0 and x.dim() == 4 and x.shape[-1] % width == 0 and x.stride(-1) == 1
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, weight, bias)))


def _rows(call, rows: int) -> None:
    native.run_in_chunks(call, rows, native.chunk_count(rows, MIN_ROWS_PER_CHUNK))


def softmax_pair(z: torch.Tensor) -> torch.Tensor:
    """[softmax(z), softmax(-z)] over the last axis of a contiguous z [..., d]: [..., 2 d]."""
    d = z.shape[-1]
    out = torch.empty(*z.shape[:-1], 2 * d, dtype=torch.float32)  # not the default dtype: C writes floats
    lib = library()
    _rows(lambda r0, r1, _: lib.hedgehog_softmax_forward(z.data_ptr(), r0, r1, d, out.data_ptr()), z.numel() // d)
    return out


class _HedgehogFeatures(torch.autograd.Function):
    """phi(x) = [softmax(z), softmax(-z)], z = x W^T + b per head; saves x, W and phi(x) for the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        b, h, _, d = x.shape
        z = products.product(x, weight.transpose(1, 2).expand(b, h, d, d), bias.expand(b, h, 1, d))
        features = softmax_pair(z)
        ctx.save_for_backward(x, weight, features)
        return features

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_features):
        x, weight, features = ctx.saved_tensors
        b, h, _, d = x.shape
        grad_features = grad_features.contiguous()
        grad_z = torch.empty(x.shape, dtype=torch.float32)
        lib = library()
        _rows(lambda r0, r1, _: lib.hedgehog_softmax_backward(features.data_ptr(), grad_features.data_ptr(), r0, r1,
                                                             d, grad_z.data_ptr()), grad_z.numel() // d)
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
    (``applies``): [B, H, N, 2 d], contiguous, with gradients for all three where autograd records them."""
    return _HedgehogFeatures.apply(x, weight, bias)
