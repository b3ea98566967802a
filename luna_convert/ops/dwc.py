"""``depthwise_conv_tokens``: depthwise Conv1d/Conv2d over tokens in the [..., tokens, C] layout
as shifted multiply-adds, with a matching backward. Its reference is torch's own depthwise
convolution on the channels-first tensor (tests/test_kernels.py).

``depthwise_conv_tokens_plus``: the DWC branch (text or patch grid) plus the attention output."""

from __future__ import annotations

import itertools
import math

import torch

# Depthwise conv backward: bytes of each per-tap product for the weight gradient.
DWC_CHUNK_BYTES = 1 << 20


def _shift_slices(n: int, s: int) -> tuple[slice, slice] | None:
    """(dst, src) with dst[t] <- src[t + s] for the t where 0 <= t + s < n; None if empty."""
    if abs(s) >= n:
        return None
    # no min/max of n: with a symbolic n (torch.export's dynamic lengths) each would add a guard
    return (slice(0, n - s), slice(s, n)) if s >= 0 else (slice(-s, n), slice(0, n + s))


def _zero_padded(part: torch.Tensor, dst: tuple, grid: tuple) -> torch.Tensor:
    """``part`` placed at ``dst`` (a tap's destination, ``_shift_slices`` on each grid axis) of zeros of the
    grid's shape: one constant pad, out of place."""
    widths = [0, 0]  # the channel axis, then the grid axes from the last
    for axis, n in reversed(list(zip(dst[1:-1], grid))):
        widths += [axis.start, n - axis.stop]
    return torch.nn.functional.pad(part, widths)


class _DepthwiseConv(torch.autograd.Function):
    """Depthwise cross-correlation, zero padding k // 2, over the grid axes of x [..., *grid, C]."""

    @staticmethod
    def _taps(x, weight, ndim):
        channels, kernel = weight.shape[0], weight.shape[2:]
        grid = x.shape[-1 - ndim:-1]
        taps = []
        for t, offsets in enumerate(itertools.product(*(range(k) for k in kernel))):
            pairs = [_shift_slices(n, j - k // 2) for n, j, k in zip(grid, offsets, kernel)]
            if any(p is None for p in pairs):
                taps.append((t, None, None))
                continue
            lead = (Ellipsis,)
            dst = lead + tuple(p[0] for p in pairs) + (slice(None),)
            src = lead + tuple(p[1] for p in pairs) + (slice(None),)
            taps.append((t, dst, src))
        centre = sum((k // 2) * math.prod(kernel[i + 1:]) for i, k in enumerate(kernel))
        return weight.reshape(channels, -1), taps, centre

    @staticmethod
    def forward(ctx, x, weight, bias, ndim):
        w, taps, centre = _DepthwiseConv._taps(x, weight, ndim)
        out = x * w[:, centre] if bias is None else torch.addcmul(bias, x, w[:, centre])
        exporting = torch.compiler.is_exporting()
        for t, dst, src in taps:
            if t != centre and dst is not None:
                if exporting:  # an exported write into a view copies the whole tensor (slice_scatter)
                    out = out + _zero_padded(x[src] * w[:, t], dst, x.shape[-1 - ndim:-1])
                else:
                    out[dst].addcmul_(x[src], w[:, t])
        ctx.ndim, ctx.has_bias = ndim, bias is not None
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        w, taps, centre = _DepthwiseConv._taps(x, weight, ctx.ndim)
        reduce_dims = tuple(range(grad.dim() - 1))
        grad_x = grad * w[:, centre] if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for t, dst, src in taps:
            if dst is not None and grad_x is not None and t != centre:
                grad_x[src].addcmul_(grad[dst], w[:, t])
        if grad_w is not None:
            # sum over rows of grad[dst] * x[src], a few leading rows (batch x heads) at a time:
            # the products stay cache-sized instead of one full-size temporary per tap.
            grid_shape = grad.shape[-1 - ctx.ndim:]
            rows_g, rows_x = grad.reshape(-1, *grid_shape), x.reshape(-1, *grid_shape)
            step = max(1, DWC_CHUNK_BYTES // (math.prod(grid_shape) * grad.element_size()))
            dims = tuple(range(ctx.ndim + 1))
            for r in range(0, rows_g.shape[0], step):
                g_rows, x_rows = rows_g[r:r + step], rows_x[r:r + step]
                for t, dst, src in taps:
                    if dst is not None:
                        grad_w[:, t] += (g_rows[dst] * x_rows[src]).sum(dims)
        grad_b = grad.sum(reduce_dims) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None if grad_w is None else grad_w.view_as(weight), grad_b, None


def depthwise_conv_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise convolution over tokens, in the [..., tokens, C] layout attention already uses.

    ``x`` is [..., N, C] with a ``Conv1d(C, C, k, padding=k//2, groups=C)`` weight
    [C, 1, k], or [..., H, W, C] with a ``Conv2d`` weight [C, 1, kh, kw]; odd kernel
    sizes. Same result as that convolution applied to x moved to channels-first,
    without the transposes: k (or kh * kw) shifted multiply-adds, and a backward
    of the same kind (PyTorch's CPU depthwise convolution backward is several
    times slower). The DWC branch in ``layers.attention.DepthwiseConvBranch`` can call it.
    """
    ndim = weight.dim() - 2
    if any(k % 2 == 0 for k in weight.shape[2:]):
        raise ValueError(f"odd kernel sizes only, got {tuple(weight.shape[2:])}")
    if x.dim() < ndim + 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} does not match a depthwise weight {tuple(weight.shape)}")
    return _DepthwiseConv.apply(x, weight, bias, ndim)


def depthwise_conv_tokens_plus(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               addend: torch.Tensor | None, keep: torch.Tensor | None = None,
                               grid: tuple[int, int] | None = None, num_prefix: int = 0) -> torch.Tensor:
    """The DWC branch over x [B, H, N, C], plus ``addend`` (no add where it is None), as a fresh tensor.

    Text (``grid`` None): ``depthwise_conv_tokens(x m, weight, bias) m`` with a ``Conv1d`` weight [C, 1, k];
    m = ``keep`` [B, N] (bool, True = a real token) over the tokens, 1 without it. Images: a ``Conv2d``
    weight [C, 1, kh, kw] over the ``grid`` (gh, gw) of patches that follow ``num_prefix`` prefix tokens
    (CLS, registers), row-major; the prefix tokens get no branch, and there is no key mask.
    """
    b, h, n, c = x.shape
    if weight.dim() != (3 if grid is None else 4):
        raise ValueError(f"a {'Conv1d' if grid is None else 'Conv2d'} weight is needed, got {tuple(weight.shape)}")
    if grid is not None:
        if keep is not None:
            raise ValueError("the DWC branch over a patch grid takes no key mask")
        if n - num_prefix != grid[0] * grid[1]:
            raise ValueError(f"DWC expects {grid[0]}x{grid[1]} patches after {num_prefix} prefix tokens, "
                             f"got {n - num_prefix}")
        patches = x[:, :, num_prefix:].reshape(b, h, *grid, c)
        out = torch.nn.functional.pad(depthwise_conv_tokens(patches, weight, bias).reshape(b, h, -1, c),
                                      (0, 0, num_prefix, 0))
    elif keep is None:
        out = depthwise_conv_tokens(x, weight, bias)
    else:
        keep = keep.view(x.shape[0], 1, x.shape[2], 1)  # bool: the products promote it, no float copy
        out = depthwise_conv_tokens(x * keep, weight, bias).mul_(keep)
    return out if addend is None else out.add_(addend)  # in place into the fresh output: nothing saves it
