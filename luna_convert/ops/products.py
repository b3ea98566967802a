"""The linear-attention core's batched products over tokens, x^T y (a long sum over tokens into a small
block) and x w (many token rows times a small block), natively (``token_products.c``) where it applies and
with ``torch.bmm``, their reference, everywhere else.

The native code applies to float32 CPU tensors of three dims with unit column stride, in eager code, where
no gradient is recorded, on a CPU with AVX-512 or AVX2 and FMA, once ``ops.native`` has built the library.
On this project's machine it runs the core's shapes (12 heads x 4,096 tokens, 64 features, 64 or 65
columns) at 82-97 GFLOP/s on one thread against 55-70 for ``torch.bmm`` (docs/performance-log.md,
*Session 21*). Its sums round as fused multiply-adds in its own order: equal to ``torch.bmm`` to float32
rounding, not to the bit.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import native

NATIVE_SOURCE = Path(__file__).with_name("token_products.c")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
NATIVE_SIGNATURES = {
    "transposed_product": [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _I64, _I64, _I64, _I64, _I64, _I64],
    "product": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64],
}
# Multiply-adds per thread chunk at the least: below that a hand-off costs more than the work.
NATIVE_MIN_CHUNK = 1 << 18


def native_library() -> ctypes.CDLL | None:
    """The compiled ``token_products.c`` if it has vector code for this CPU, else None."""
    lib = native.load_library(NATIVE_SOURCE, NATIVE_SIGNATURES)
    return lib if lib is not None and lib.product_lanes() > 0 else None


def native_status() -> str:
    """"on", or "off: <why>" (what the bench records beside its timings)."""
    status = native.status(NATIVE_SOURCE, NATIVE_SIGNATURES)
    if status == "on" and native_library() is None:
        return "off: no AVX2 with FMA or AVX-512 on this CPU"
    return status


def _native_applies(streamed: tuple[torch.Tensor, ...], small: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether the native code takes these: ``streamed`` operands, [B, N, .] in unit column stride as they
    are, and ``small`` ones, which it takes as contiguous copies where they are not. Never while compiling
    (checked first: dynamo then reads no further)."""
    if torch.compiler.is_compiling():
        return False
    tensors = (*streamed, *small)
    return (all(t.dim() == 3 and t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and all(t.stride(-1) == 1 for t in streamed)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and native_library() is not None)


def _chunks(batch: int, work_per_entry: int) -> int:
    return native.chunk_count(batch, max(1, NATIVE_MIN_CHUNK // max(1, work_per_entry)))


def transposed_product(x: torch.Tensor, y: torch.Tensor, with_sum: bool = False) -> torch.Tensor:
    """x^T y for x [B, N, D] and y [B, N, e]: [B, D, e], or with ``with_sum`` [B, D, e + 1] whose last
    column is x's sum over the N tokens (``torch.cat([x^T y, x.sum(1)[..., None]], -1)``)."""
    if not _native_applies((x, y)):
        product_t = torch.bmm(x.transpose(1, 2), y)
        return torch.cat([product_t, x.sum(1).unsqueeze_(-1)], -1) if with_sum else product_t
    (b, n, depth), columns = x.shape, y.shape[-1]
    out = torch.empty(b, depth, columns + with_sum)
    lib = native_library()
    args = (n, depth, columns, int(with_sum), x.stride(0), x.stride(1), y.stride(0), y.stride(1), out.stride(0),
            out.stride(1))
    native.run_in_chunks(lambda b0, b1, _: lib.transposed_product(x.data_ptr(), y.data_ptr(), out.data_ptr(), b0, b1,
                                                                  *args), b, _chunks(b, n * depth * columns))
    return out


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x w for x [B, N, D] and w [B, D, e]: [B, N, e] (``torch.bmm(x, w)``); with a ``bias`` [B, 1, e], x w + bias
    (``torch.baddbmm(bias, x, w)``)."""
    small = (w,) if bias is None else (w, bias)
    if not _native_applies((x,), small):
        return torch.bmm(x, w) if bias is None else torch.baddbmm(bias, x, w)
    (b, n, depth), columns = x.shape, w.shape[-1]
    w = w if w.stride(-1) == 1 else w.contiguous()
    bias = None if bias is None else bias.expand(b, 1, columns).contiguous()
    out = torch.empty(b, n, columns)
    lib = native_library()
    bias_pointer = 0 if bias is None else bias.data_ptr()
    args = (n, depth, columns, x.stride(0), x.stride(1), w.stride(0), w.stride(1), 0 if bias is None else columns,
            out.stride(0), out.stride(1))
    native.run_in_chunks(lambda b0, b1, _: lib.product(x.data_ptr(), w.data_ptr(), bias_pointer, out.data_ptr(), b0,
                                                       b1, *args), b, _chunks(b, n * depth * columns))
    return out
