"""The additive sorting kernel's attention as native passes (``sorting_sums.c``), float32 on the CPU:
the forward, and its backward where a gradient is recorded.

The PyTorch path (``sorting.sorted_kernel_sums``) sums each projection's decayed prefix sums in blocks of
32 keys with an explicit [32, 32] decay matrix per block, carried across blocks a level up: about 200
operator calls and [B, H, R, N, 65]-sized intermediates for every forward (1.6 GB at 4,096 tokens), and
autograd keeps them all for the backward. Here each projection is a radix sort of its keys and of its
queries, two scans over the sorted keys and one merge walk over the sorted queries, in a pass per
(batch, head); the backward runs the same scans and, with the roles swapped, scans over the queries'
gradients walked by the keys (the formulas are at the top of ``sorting_sums.c``). Nothing but the inputs,
the output and its denominators is kept for the backward.

Used by ``SortingKernelAttention.forward`` for float32 compute on the CPU where ``ops.native`` built the
library (compiled and exported graphs call the registered operator ``luna_convert::sorting_attention``);
everywhere else, and as the reference in tests/test_sorting.py, the PyTorch path runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..ops import native
from ..ops.dtypes import records_grad

SOURCE = Path(__file__).with_name("sorting_sums.c")
# (batch, head) rows per thread chunk at the least: one row at 512 tokens is already ~1 ms of work.
MIN_ROWS_PER_CHUNK = 1


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


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the native passes take these tensors: float32 on the CPU, the library built. Compiled and
    exported graphs call them as the registered operator ``luna_convert::sorting_attention``."""
    return all([t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors]) and native_available()


def sorting_kernel_attention(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                             w: torch.Tensor, c0: torch.Tensor, matern: bool, eps: float) -> torch.Tensor:
    """out_i = sum_j m_j k_ij v_j / (sum_j m_j k_ij + eps) with k_ij = c0 + sum_r w_r kappa(x_ri - y_rj).

    x [B, H, R, Nq] and y [B, H, R, N] the projections already divided by the bandwidths, v [B, H, N, dv],
    key_mask bool [B, N] or None, w [H, R], c0 [H]; float32 (``applies``). Returns [B, H, Nq, dv], with
    gradients for x, y, v, w and c0 where autograd records them."""
    if torch.compiler.is_compiling():
        keep = None if key_mask is None else key_mask.to(torch.bool)
        return sorting_attention_op(x, y, v, keep, w, c0, matern, eps)[0]
    if records_grad(x, y, v, w, c0):
        return _NativeSortingAttention.apply(x, y, v, key_mask, w, c0, matern, eps)
    return _forward(*_inputs(x, y, v, key_mask, w, c0), matern, eps, keep_denominators=False)[0]


def _inputs(x, y, v, key_mask, w, c0):
    """The tensors as the passes read them: x, y, w, c0 contiguous (``projected`` makes x and y so already),
    v with its channels contiguous, the mask as one byte per key."""
    keep = None if key_mask is None else key_mask.to(torch.bool).contiguous()  # one byte, 0 or 1, read as uint8
    return (x.contiguous(), y.contiguous(), v if v.stride(-1) == 1 else v.contiguous(), keep, w.contiguous(),
            c0.contiguous())


def _shared_args(x, y, v, keep, w, c0, matern) -> dict:
    """The arguments both passes take: the inputs, their sizes and the kernel's form."""
    _, heads, projections, nq = x.shape
    return dict(x=x.data_ptr(), y=y.data_ptr(), v=v.data_ptr(), v_batch_stride=v.stride(0), v_head_stride=v.stride(1),
                v_token_stride=v.stride(2), keep=0 if keep is None else keep.data_ptr(), w=w.data_ptr(),
                c0=c0.data_ptr(), heads=heads, projections=projections, nq=nq, n=y.shape[-1], values=v.shape[-1],
                matern=int(matern))


def _run(pass_name: str, rows: int, call) -> None:
    """``call(first_row, end_row, failed_flag_address)`` over the rows in thread chunks; a chunk that could
    not get its scratch memory is a MemoryError."""
    chunks = native.chunk_count(rows, MIN_ROWS_PER_CHUNK)
    failed = (ctypes.c_int32 * chunks)()  # a flag per chunk (not a tensor: no operator calls)
    native.run_in_chunks(lambda r0, r1, i: call(r0, r1, ctypes.addressof(failed) + 4 * i), rows, chunks)
    if any(failed):
        raise MemoryError(f"sorting kernel's native {pass_name}: no memory for its scratch buffers")


def _forward(x, y, v, keep, w, c0, matern, eps, keep_denominators: bool):
    """(out [B, H, Nq, dv], the denominators [B, H, Nq] or None)."""
    b, heads, _, nq = x.shape
    out = torch.empty(b, heads, nq, v.shape[-1], dtype=torch.float32)
    den = torch.empty(b, heads, nq, dtype=torch.float32) if keep_denominators else None
    args, lib = _shared_args(x, y, v, keep, w, c0, matern), library()
    _run("forward", b * heads, lambda r0, r1, failed: lib.sorting_attention_forward(
        **args, eps=eps, row0=r0, row1=r1, out=out.data_ptr(), den=0 if den is None else den.data_ptr(), failed=failed))
    return out, den


class _NativeSortingAttention(torch.autograd.Function):
    """The forward pass, then the backward pass from the inputs, the output and its denominators."""

    @staticmethod
    def forward(ctx, x, y, v, key_mask, w, c0, matern, eps):
        inputs = _inputs(x, y, v, key_mask, w, c0)
        out, den = _forward(*inputs, matern, eps, keep_denominators=True)
        ctx.matern = matern
        ctx.save_for_backward(*inputs, out, den)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad_x, grad_y, grad_v, grad_w, grad_c0 = _backward(grad_out, *ctx.saved_tensors, ctx.matern)
        return grad_x, grad_y, grad_v, None, grad_w, grad_c0, None, None


def _backward(grad_out, x, y, v, keep, w, c0, out, den, matern):
    """The backward pass: the gradients of x, y, v, w and c0 (inputs as ``_inputs`` lays them out)."""
    b, heads, projections, _ = x.shape
    grad_x, grad_y = torch.empty_like(x), torch.empty_like(y)
    grad_v = torch.empty(b, heads, v.shape[2], v.shape[3], dtype=torch.float32)
    grad_w = torch.empty(b, heads, projections, dtype=torch.float32)  # per row: summed below
    grad_c0 = torch.empty(b, heads, dtype=torch.float32)
    grad_out = grad_out.contiguous()
    args, lib = _shared_args(x, y, v, keep, w, c0, matern), library()
    _run("backward", b * heads, lambda r0, r1, failed: lib.sorting_attention_backward(
        **args, grad_out=grad_out.data_ptr(), out=out.data_ptr(), den=den.data_ptr(), row0=r0, row1=r1,
        grad_x=grad_x.data_ptr(), grad_y=grad_y.data_ptr(), grad_v=grad_v.data_ptr(), grad_w=grad_w.data_ptr(),
        grad_c0=grad_c0.data_ptr(), failed=failed))
    return grad_x, grad_y, grad_v, grad_w.sum(0), grad_c0.sum(0)


def sorting_attention_reference(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                                w: torch.Tensor, c0: torch.Tensor, matern: bool, eps: float) -> torch.Tensor:
    """``sorting_kernel_attention`` in its explicit N x N form (kappa(t) = exp(-|t|), or (1 + |t|) exp(-|t|) for
    matern): the reference of ``luna_convert::sorting_attention``, in the inputs' dtype, quadratic in memory."""
    t = (x[..., :, None] - y[..., None, :]).abs()  # [B, H, R, Nq, N]
    profile = torch.exp(-t) if not matern else (1 + t) * torch.exp(-t)
    k = c0[None, :, None, None] + torch.einsum("hr,bhrqn->bhqn", w, profile)
    if key_mask is not None:
        k = k * key_mask[:, None, None, :].to(k.dtype)
    return (k @ v) / (k.sum(-1, keepdim=True) + eps)


# The passes as registered operators (schema, fake outputs, autograd): what compiled and exported graphs call.
# The forward returns the denominators too, which its backward reads. Eager code calls the passes directly.
@torch.library.custom_op("luna_convert::sorting_attention", mutates_args=(), device_types="cpu")
def sorting_attention_op(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                         w: torch.Tensor, c0: torch.Tensor, matern: bool,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Nq, dv], the denominators [B, H, Nq]) of ``sorting_kernel_attention``; ``keep`` bool [B, N]."""
    return _forward(*_inputs(x, y, v, keep, w, c0), matern, eps, keep_denominators=True)


@sorting_attention_op.register_fake
def _sorting_attention_shape(x, y, v, keep, w, c0, matern, eps):
    b, heads, _, nq = x.shape
    return x.new_empty((b, heads, nq, v.shape[-1])), x.new_empty((b, heads, nq))


@torch.library.custom_op("luna_convert::sorting_attention_backward", mutates_args=(), device_types="cpu")
def sorting_attention_backward_op(grad: torch.Tensor, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor,
                                  keep: torch.Tensor | None, w: torch.Tensor, c0: torch.Tensor, out: torch.Tensor,
                                  den: torch.Tensor, matern: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                            torch.Tensor, torch.Tensor]:
    """The gradients of x, y, v, w and c0 of ``sorting_attention``, natively."""
    return _backward(grad, *_inputs(x, y, v, keep, w, c0), out.contiguous(), den.contiguous(), matern)


@sorting_attention_backward_op.register_fake
def _sorting_attention_backward_shape(grad, x, y, v, keep, w, c0, out, den, matern):
    return (x.new_empty(x.shape), y.new_empty(y.shape), v.new_empty(v.shape), w.new_empty(w.shape),
            c0.new_empty(c0.shape))


def _sorting_context(ctx, inputs, output):
    x, y, v, keep, w, c0, matern, eps = inputs
    ctx.matern = matern
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, y, v, keep, w, c0, *output)


def _sorting_backward(ctx, grad_out, grad_den):
    x, y, v, keep, w, c0, out, den = ctx.saved_tensors
    grad_x, grad_y, grad_v, grad_w, grad_c0 = sorting_attention_backward_op(grad_out, x, y, v, keep, w, c0, out, den,
                                                                            ctx.matern)
    return grad_x, grad_y, grad_v, None, grad_w, grad_c0, None, None


sorting_attention_op.register_autograd(_sorting_backward, setup_context=_sorting_context)
