"""LUNA's channel bank and its feature norm in one native pass (``luna_channels.c``), float32 on the CPU.

The PyTorch path of ``luna_kernel`` evaluates a map in about twenty operator calls over [B, H, N, M, L]
(the grid search, two row gathers, a multiply-add and a relu, then ``ops.normalize.sum_normalize``): each
call is its own memory pass and its own parallel region, and on a machine busy with other work every
parallel region waits for its slowest thread. Here the whole map is one call: one read of u, one write of
the features, the norm done per row while it is in cache. Its backward recomputes the features from u
(a few nanoseconds a scalar) instead of keeping them, so the layer saves u and nothing else for it.

Used by ``luna_kernel.channel_features_of`` when ``ops.native`` could build the library (a C compiler is
there and ``LUNA_CONVERT_NATIVE`` is not 0), for float32 compute on the CPU; compiled and exported graphs
call the same passes as registered operators (``luna_kernel``: ``luna_convert::luna_channel_features`` and
its backward, ``luna_convert::luna_projected_channel_features``). Everywhere
else, and as the reference in tests/test_luna_native.py, the PyTorch path runs. Both locate with a
``luna_kernel.KnotLocator`` grid; the native one computes the knots' cells with the library's own cell
function (``native_cells``), the one its search uses for the inputs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..ops import native

SOURCE = Path(__file__).with_name("luna_channels.c")
# The limits of luna_channels.c: channels L, scalars located per pass (so projections M), features per row.
MAX_CHANNELS, BLOCK, MAX_ROW = 64, 1024, 8192
# Rows (tokens x heads) per chunk at the least: below that a thread hand-off costs more than the work.
MIN_ROWS_PER_CHUNK = 256
MAPPINGS = {"linear": 0, "squashed": 1}


def library() -> native.NativeFunctions | None:
    """The compiled kernel's functions, or None (``ops.native.unavailable_reason(SOURCE)`` says why)."""
    return native.load_library(SOURCE)


def status() -> str:
    """"on", or "off: <why>" (what the bench records beside its timings)."""
    return native.status(SOURCE)


@native.constant_in_graphs
def native_available() -> bool:
    """Whether the library is built; a constant of a compiled graph (dynamo cannot trace its loading)."""
    return library() is not None


def fits(projections: int, channels: int) -> bool:
    """Whether a map of M projections and L channels is within the kernel's fixed buffers."""
    return channels <= MAX_CHANNELS and projections <= BLOCK and projections * channels <= MAX_ROW


def native_cells(x: torch.Tensor, mapping: str, low: float, scale: float, cells: int) -> torch.Tensor:
    """The grid cell of every element of x by the kernel's own arithmetic (a ``KnotLocator`` cells_of)."""
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.int32)
    library().luna_cells(x=x.data_ptr(), n=x.numel(), mapping=MAPPINGS[mapping], low=low, scale=scale, cells=cells,
                         out=out.data_ptr())
    return out


def _shared_args(projections: int, slope: torch.Tensor, intercept: torch.Tensor, grid: tuple, eps: float) -> dict:
    """The arguments every kernel call takes: M, L, the grid, the tables, eps."""
    mapping, low, scale, cells, start, kpad = grid
    return dict(M=projections, L=slope.shape[1], mapping=MAPPINGS[mapping], low=low, scale=scale, cells=cells,
                most=kpad.shape[0], start=start.data_ptr(), kpad=kpad.data_ptr(), slope=slope.data_ptr(),
                intercept=intercept.data_ptr(), eps=eps)


def forward_pass(u: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, grid: tuple,
                  eps: float) -> torch.Tensor:
    """``luna_channels_forward`` over u [..., M] (float32, contiguous): the features [..., M, L]."""
    lib, rows, head = library(), u.numel() // u.shape[-1], _shared_args(u.shape[-1], slope, intercept, grid, eps)
    out = torch.empty(*u.shape, slope.shape[1], dtype=torch.float32)
    native.run_in_chunks(lambda r0, r1, _: lib.luna_channels_forward(x=u.data_ptr(), r0=r0, r1=r1, **head,
                                                                       out=out.data_ptr()),
                         rows, native.chunk_count(rows, MIN_ROWS_PER_CHUNK))
    return out


def backward_pass(u: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, grid: tuple, eps: float,
                   grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``luna_channels_backward``: the gradients of u, slope and intercept from the features' gradient."""
    lib, rows = library(), u.numel() // u.shape[-1]
    head = _shared_args(u.shape[-1], slope, intercept, grid, eps)
    grad_out = grad_out.to(torch.float32).contiguous()
    grad_u = torch.empty_like(u)
    chunks = native.chunk_count(rows, MIN_ROWS_PER_CHUNK)
    # Per-interval sums, one float64 table per chunk (no two threads add into one), summed after.
    sums = torch.zeros(2, chunks, *slope.shape, dtype=torch.float64)
    native.run_in_chunks(lambda r0, r1, i: lib.luna_channels_backward(
        x=u.data_ptr(), r0=r0, r1=r1, **head, grad_out=grad_out.data_ptr(), grad_x=grad_u.data_ptr(),
        grad_slope=sums[0, i].data_ptr(), grad_intercept=sums[1, i].data_ptr()), rows, chunks)
    grad_slope, grad_intercept = sums.sum(1).to(slope.dtype).unbind(0)
    return grad_u, grad_slope, grad_intercept


class _NativeChannelFeatures(torch.autograd.Function):
    """Features [..., M, L] of u [..., M] (float32, contiguous); eps < 0: no feature norm."""

    @staticmethod
    def forward(ctx, u, slope, intercept, grid, eps, track):
        if track:
            ctx.grid, ctx.eps = grid, eps
            ctx.save_for_backward(u, slope, intercept)
        return forward_pass(u, slope, intercept, grid, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        u, slope, intercept = ctx.saved_tensors
        return (*backward_pass(u, slope, intercept, ctx.grid, ctx.eps, grad_out), None, None, None)


def native_channel_features(u: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, grid: tuple,
                            norm_eps: float | None) -> torch.Tensor:
    """relu(slope[i] u + intercept[i]) for every scalar of u [..., M] (i its interval on ``grid``, a
    ``KnotLocator.grid`` built with ``native_cells``): [..., M, L] float32; with ``norm_eps`` each channel
    then divided by (its sum over the M projections + norm_eps)."""
    x = u.to(torch.float32).contiguous()
    track = torch.is_grad_enabled() and (x.requires_grad or slope.requires_grad or intercept.requires_grad)
    eps = -1.0 if norm_eps is None else float(norm_eps)
    return _NativeChannelFeatures.apply(x, slope.contiguous(), intercept.contiguous(), grid, eps, track)


def native_projected_channel_features(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, slope: torch.Tensor,
                                      intercept: torch.Tensor, grid: tuple, norm_eps: float | None) -> torch.Tensor:
    """``native_channel_features`` of u = x W^T + b for x [B, H, N, d] (float32, any strides but a last of 1,
    e.g. heads split from [B, N, H*d]), ``weight_t`` W^T [d, M] and b [M] (float32, contiguous): u is computed
    block by block inside the pass, never written out, and x is read where it lies. No gradients: for
    inference (``luna_kernel.projected_channel_features_of`` checks)."""
    b, h, n, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    lib, rows, slope, intercept = library(), b * h * n, slope.contiguous(), intercept.contiguous()
    head = _shared_args(weight_t.shape[1], slope, intercept, grid, -1.0 if norm_eps is None else float(norm_eps))
    out = torch.empty(b, h, n, weight_t.shape[1], slope.shape[1], dtype=torch.float32)
    layout = _layout(x, h, n, d, weight_t, bias)
    native.run_in_chunks(lambda r0, r1, _: lib.luna_channels_forward_projected(**layout, r0=r0, r1=r1, **head,
                                                                               out=out.data_ptr()),
                         rows, native.chunk_count(rows, MIN_ROWS_PER_CHUNK))
    return out


def _layout(x: torch.Tensor, heads: int, tokens: int, d: int, weight_t: torch.Tensor, bias: torch.Tensor) -> dict:
    """The projected kernels' first arguments: x where it lies (its strides), W^T and b."""
    return dict(x=x.data_ptr(), heads=heads, tokens=tokens, stride_b=x.stride(0), stride_h=x.stride(1),
                stride_n=x.stride(2), d=d, wt=weight_t.data_ptr(), bias=bias.data_ptr())
