"""``depthwise_conv_tokens``: depthwise Conv1d/Conv2d over tokens in the [..., tokens, C] layout
as shifted multiply-adds, with a matching backward. Its reference is torch's own depthwise
convolution on the channels-first tensor (tests/test_kernels.py).

``depthwise_conv_tokens_plus``: the DWC branch (text or patch grid) plus the attention output, in one
native pass (``dwc_tokens.c``) where no gradient is recorded, else with ``depthwise_conv_tokens`` and an add."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch

from . import native
from .linear import divide_by_last_column

NATIVE_SOURCE = Path(__file__).with_name("dwc_tokens.c")
NATIVE_MAX_CHANNELS = 4096  # MAX_C of dwc_tokens.c
# Floats of work per thread chunk at the least: below that a hand-off costs more than the pass.
NATIVE_MIN_CHUNK = 1 << 16

# Depthwise conv backward: bytes of each per-tap product for the weight gradient.
DWC_CHUNK_BYTES = 1 << 20


def _shift_slices(n: int, s: int) -> tuple[slice, slice] | None:
    """(dst, src) with dst[t] <- src[t + s] for the t where 0 <= t + s < n; None if empty."""
    if abs(s) >= n:
        return None
    # no min/max of n: with a symbolic n (torch.export's dynamic lengths) each would add a guard
    return (slice(0, n - s), slice(s, n)) if s >= 0 else (slice(-s, n), slice(0, n + s))


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
        for t, dst, src in taps:
            if t != centre and dst is not None:
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


def native_library() -> native.NativeFunctions | None:
    """The compiled ``dwc_tokens.c``'s functions, or None (``ops.native.unavailable_reason(NATIVE_SOURCE)`` says why)."""
    return native.load_library(NATIVE_SOURCE)


def native_status() -> str:
    """"on", or "off: <why>" (what the bench records beside its timings)."""
    return native.status(NATIVE_SOURCE)


@native.constant_in_graphs
def native_available() -> bool:
    """Whether the library is built; a constant of a compiled graph (dynamo cannot trace its loading)."""
    return native_library() is not None


def _native_applies(x, weight, bias, addend, divided: bool) -> bool:
    """Whether ``dwc_tokens.c`` takes these tensors: float32 on the CPU, an addend, no division where a gradient
    is recorded (the layer divides there only without one), the library built. Compiled and exported graphs
    call it as the registered operator ``luna_convert::dwc_tokens_plus``."""
    tensors = [t for t in (x, weight, bias, addend) if t is not None]
    return (addend is not None and x.dim() == 4 and x.shape[-1] <= NATIVE_MAX_CHANNELS
            and addend.shape == (*x.shape[:-1], x.shape[-1] + divided) and x.stride(-1) == 1
            and all([t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors])
            and not (divided and _records_grad(*tensors)) and native_available())


def _records_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any([t.requires_grad for t in tensors])  # a list: see products


def _token_chunks(rows: int, heads: int, channels: int) -> int:
    """Thread chunks for the native passes over ``rows`` tokens of ``heads`` x ``channels`` floats each."""
    return native.chunk_count(rows, max(1, NATIVE_MIN_CHUNK // max(1, heads * channels)))


def _native_pass(x, weight, bias, addend, keep, divide, layout) -> torch.Tensor:
    """``dwc_tokens_forward`` over x [B, H, N, C]: the branch plus addend, [B, H, N, C] as a view of token-major
    memory. ``keep`` uint8 [B, N] or None; ``layout`` (prefix, grid_h, grid_w, kh, kw)."""
    b, h, n, c = x.shape
    out = torch.empty(b, n, h, c, dtype=torch.float32)  # token-major (see depthwise_conv_tokens_plus)
    addend = addend.contiguous()
    taps = weight.reshape(c, -1).t().contiguous()  # [kh kw, C]: each tap's weights contiguous
    bias = None if bias is None else bias.contiguous()
    lib, rows = native_library(), b * n  # a thread's rows: tokens, all heads of each
    mode, eps = (0, 0.0) if divide is None else (2 if divide[1] else 1, float(divide[0]))
    prefix, grid_h, grid_w, kh, kw = layout
    args = dict(heads=h, n=n, channels=c, sb=x.stride(0), sh=x.stride(1), sn=x.stride(2), prefix=prefix,
                grid_h=grid_h, grid_w=grid_w, w=taps.data_ptr(), kh=kh, kw=kw,
                bias=0 if bias is None else bias.data_ptr(), keep=0 if keep is None else keep.data_ptr(),
                addend=addend.data_ptr(), divide=mode, eps=eps, out=out.data_ptr())
    native.run_in_chunks(lambda r0, r1, _: lib.dwc_tokens_forward(x=x.data_ptr(), r0=r0, r1=r1, **args), rows,
                         _token_chunks(rows, h, c))
    return out.transpose(1, 2)


def _native_backward(x, weight, keep, layout, has_bias: bool, grad):
    """``dwc_tokens_backward``: the gradients of x, the weight and the bias from the output's gradient."""
    b, h, n, c = x.shape
    prefix, grid_h, grid_w, kh, kw = layout
    grad_tokens = grad.transpose(1, 2).contiguous()  # [B, N, H, C]: the order the pass reads and writes
    grad_x = torch.empty_like(grad_tokens)
    taps = weight.reshape(c, -1).t().contiguous()
    rows = b * n
    chunks = _token_chunks(rows, h, c)
    # Per chunk double sums (no two threads add into one), added up after.
    sums_w = torch.zeros(chunks, kh * kw, c, dtype=torch.float64)
    sums_b = torch.zeros(chunks, c, dtype=torch.float64)
    args = dict(heads=h, n=n, channels=c, sb=x.stride(0), sh=x.stride(1), sn=x.stride(2), prefix=prefix,
                grid_h=grid_h, grid_w=grid_w, w=taps.data_ptr(), kh=kh, kw=kw, keep=0 if keep is None else keep.data_ptr(),
                grad_out=grad_tokens.data_ptr(), grad_x=grad_x.data_ptr())
    native.run_in_chunks(lambda r0, r1, i: native_library().dwc_tokens_backward(
        x=x.data_ptr(), r0=r0, r1=r1, **args, grad_w=sums_w[i].data_ptr(), grad_b=sums_b[i].data_ptr()), rows, chunks)
    grad_w = sums_w.sum(0).t().reshape(weight.shape).to(weight.dtype)
    grad_b = sums_b.sum(0).to(weight.dtype) if has_bias else None
    return grad_x.transpose(1, 2), grad_w, grad_b


# The native pass as a registered operator (schema, fake output, autograd): what compiled and exported graphs
# call. Eager code calls ``_native_pass`` and ``_NativeDepthwiseConvPlus`` directly, without the dispatcher.
@torch.library.custom_op("luna_convert::dwc_tokens_plus", mutates_args=(), device_types="cpu")
def dwc_tokens_plus_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, addend: torch.Tensor,
                       keep: torch.Tensor | None, layout: list[int], divided: bool, eps: float,
                       clamp: bool) -> torch.Tensor:
    """The DWC branch of x plus ``addend`` (divided by its last column when ``divided``), natively."""
    if x.stride(-1) != 1:  # a graph may hand other layouts than it was traced with
        x = x.contiguous()
    return _native_pass(x, weight, bias, addend, keep, (eps, clamp) if divided else None, tuple(layout))


@dwc_tokens_plus_op.register_fake
def _dwc_tokens_plus_shape(x, weight, bias, addend, keep, layout, divided, eps, clamp):
    b, h, n, c = x.shape
    return x.new_empty((b, n, h, c)).transpose(1, 2)  # token-major memory, as the pass writes it


def _dwc_context(ctx, inputs, output):
    x, weight, bias, addend, keep, layout, divided, eps, clamp = inputs
    if divided:  # the layer divides only where no gradient is recorded
        raise RuntimeError("dwc_tokens_plus has no gradient through the division of its addend")
    ctx.layout, ctx.has_bias = tuple(layout), bias is not None
    ctx.save_for_backward(x, weight, keep)


@torch.library.custom_op("luna_convert::dwc_tokens_backward", mutates_args=(), device_types="cpu")
def dwc_tokens_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor | None,
                           layout: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, the weight and the bias of the DWC branch, natively."""
    grad_x, grad_w, grad_b = _native_backward(x.contiguous(), weight, keep, tuple(layout), True, grad)
    return grad_x.contiguous(), grad_w.contiguous(), grad_b  # the layouts the fake outputs promise (Inductor checks)


@dwc_tokens_backward_op.register_fake
def _dwc_tokens_backward_shape(grad, x, weight, keep, layout):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[:1])


def _dwc_backward(ctx, grad):
    x, weight, keep = ctx.saved_tensors
    grad_x, grad_w, grad_b = dwc_tokens_backward_op(grad, x, weight, keep, list(ctx.layout))
    return grad_x, grad_w, grad_b if ctx.has_bias else None, grad, None, None, None, None, None


dwc_tokens_plus_op.register_autograd(_dwc_backward, setup_context=_dwc_context)


class _NativeDepthwiseConvPlus(torch.autograd.Function):
    """``_native_pass`` without division, with the native backward (``dwc_tokens_backward``): training's DWC
    branch in two passes over the tokens instead of a PyTorch op per tap, each way."""

    @staticmethod
    def forward(ctx, x, weight, bias, addend, keep, layout):
        ctx.layout, ctx.has_bias = layout, bias is not None
        ctx.save_for_backward(x, weight, keep)
        return _native_pass(x, weight, bias, addend, keep, None, layout)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, keep = ctx.saved_tensors
        return (*_native_backward(x, weight, keep, ctx.layout, ctx.has_bias, grad), grad, None, None)


def depthwise_conv_tokens_plus(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               addend: torch.Tensor | None, keep: torch.Tensor | None = None,
                               divide: tuple[float, bool] | None = None, grid: tuple[int, int] | None = None,
                               num_prefix: int = 0) -> torch.Tensor:
    """The DWC branch over x [B, H, N, C], plus ``addend`` (no add where it is None), as a fresh tensor.

    Text (``grid`` None): ``depthwise_conv_tokens(x m, weight, bias) m`` with a ``Conv1d`` weight [C, 1, k];
    m = ``keep`` [B, N] (bool, True = a real token) over the tokens, 1 without it. Images: a ``Conv2d``
    weight [C, 1, kh, kw] over the ``grid`` (gh, gw) of patches that follow ``num_prefix`` prefix tokens
    (CLS, registers), row-major; the prefix tokens get no branch, and there is no key mask.

    ``divide`` (eps, clamp): the addend is the attention output before its division, [B, H, N, C + 1]
    (``ops.linear.linear_attention_unnormalised``), and what is added is
    ``ops.linear.divide_by_last_column(addend, eps, clamp)``, the same values to the bit.

    On the CPU in float32, where ``ops.native`` built ``dwc_tokens.c``: one pass that reads x and addend once
    and writes the result once (dividing as it goes), instead of a pass per tap, one for the add and two for
    the division (about 140 against 40 MB for text at 12 heads x 4,096 tokens x 64, k = 3); where a gradient
    is recorded (no division then), the same pass and a native backward pass. Its result is a [B, H, N, C]
    view of token-major memory ([B, N, H, C] contiguous), so that merging the heads back into [B, N, H C] is
    a view, not a copy. Everywhere else, and as its reference in the tests, the PyTorch ops.
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
    if _native_applies(x, weight, bias, addend, divide is not None):
        # (prefix, grid_h, grid_w, kh, kw): text is the grid 1 x N without a prefix, its kernel 1 x k
        layout = (num_prefix, *grid, *weight.shape[2:]) if grid else (0, 1, n, 1, weight.shape[2])
        keep = None if keep is None else keep.to(torch.uint8).contiguous()
        if torch.compiler.is_compiling():
            eps, clamp = divide if divide is not None else (0.0, False)
            return torch.ops.luna_convert.dwc_tokens_plus(x, weight, bias, addend, keep, list(layout),
                                                          divide is not None, float(eps), bool(clamp))
        if _records_grad(x, weight, *[t for t in (bias, addend) if t is not None]):
            return _NativeDepthwiseConvPlus.apply(x, weight, bias, addend, keep, layout)
        return _native_pass(x, weight, bias, addend, keep, divide, layout)
    return dwc_tokens_plus_reference(x, weight, bias, addend, keep, divide, grid, num_prefix)


def dwc_tokens_plus_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              addend: torch.Tensor | None, keep: torch.Tensor | None = None,
                              divide: tuple[float, bool] | None = None, grid: tuple[int, int] | None = None,
                              num_prefix: int = 0) -> torch.Tensor:
    """``depthwise_conv_tokens_plus`` in PyTorch ops: the reference of ``luna_convert::dwc_tokens_plus``, and the
    path wherever the native pass does not apply."""
    b, h, n, c = x.shape
    if divide is not None:
        addend = divide_by_last_column(addend, *divide)
    if grid is not None:
        patches = x[:, :, num_prefix:].reshape(b, h, *grid, c)
        out = torch.nn.functional.pad(depthwise_conv_tokens(patches, weight, bias).reshape(b, h, -1, c),
                                      (0, 0, num_prefix, 0))
    elif keep is None:
        out = depthwise_conv_tokens(x, weight, bias)
    else:
        keep = keep.view(x.shape[0], 1, x.shape[2], 1)  # bool: the products promote it, no float copy
        out = depthwise_conv_tokens(x * keep, weight, bias).mul_(keep)
    return out if addend is None else out.add_(addend)  # in place into the fresh output: nothing saves it
