"""Exponentials of rows in one pass per row, natively (``exp_rows.c``), with each function's PyTorch reference
beside it: Hedgehog's pair of softmaxes [softmax(z), softmax(-z)] and its backward, and the stabilised
exps of positive random features (Performer, Flexformer's positive variant), exp(x - its row's max) and
exp(x - a given shift), in place. Also features made from them inside the core's products: the random
features' queries and keys (``exp_minus_row_max_rows``, ``positive_key_rows``) and the fixed elementwise maps'
(``pointwise_feature_rows``: ReLU, ELU + 1, cosFormer; ELU's needs the exp).

In PyTorch each of these is three to five calls, each a pass over the rows in memory (for the softmax pair:
two softmaxes, the negation between them, the cat; for the stabilised exp: the max, the subtraction, the
exp). Here a row is read once, worked on while it is in cache and written once.

Native where ``applies``: float32 contiguous CPU tensors, ``ops.native`` built the library; the softmax pair
also needs its width to be a multiple of ``lanes()`` (8, or 16 with AVX-512). Callers keep the reference path
for everything else (tests/test_exp_rows.py checks one against the other). Eager code calls the C functions
directly; compiled and exported graphs call the softmax pair as a registered operator
(``luna_convert::softmax_pair``, its backward ``luna_convert::softmax_pair_backward``), and the makers go into
the graph as declarations that the made-rows operators build (``ops.products.ProducedRows``). The in-place
exps stay eager (``applies``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import native, products
from .products import BuiltRows, ProducedRows, made

SOURCE = Path(__file__).with_name("exp_rows.c")
# Rows per thread chunk at the least: below that a hand-off costs more than the work.
MIN_ROWS_PER_CHUNK = 256
# pointwise_rows' kinds (exp_rows.c's enum)
POINTWISE_KINDS = {"relu": 0, "elu": 1, "cosformer": 2}


def library() -> native.NativeFunctions | None:
    """The compiled kernels, or None (``ops.native.unavailable_reason(SOURCE)`` says why)."""
    return native.load_library(SOURCE)


@native.constant_in_graphs
def available() -> bool:
    """Whether the library is built; a constant of a compiled graph (dynamo cannot trace its loading)."""
    return library() is not None


def rows_apply(*tensors: torch.Tensor) -> bool:
    """Whether a map may hand these (its inputs and parameters) to the products as rows this library's makers
    make: ``products.produced_rows_apply``, and the library built."""
    return products.produced_rows_apply(*tensors) and available()


def status() -> str:
    """"on", or "off: <why>" (what the bench and ``luna-convert methods --details`` show)."""
    return native.status(SOURCE)


@native.constant_in_graphs
def lanes() -> int:
    """Floats per vector in the built library (8 or 16): the softmax pair's width must be a multiple of it; 0
    without a library."""
    lib = library()
    return 0 if lib is None else lib.exp_rows_lanes()


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the native code takes these: float32 contiguous CPU tensors, the library built (in compiled
    graphs too: the softmax pair is an operator there)."""
    return (all([t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors])
            and available())


def applies(*tensors: torch.Tensor) -> bool:
    """``takes``, in eager code: the in-place exps' caller (Performer's stabilised exp) is an autograd.Function
    that marks its input dirty, which dynamo does not trace; compiled graphs call ``stabilised_exp_op``."""
    return not torch.compiler.is_compiling() and takes(*tensors)


def _over_rows(call, rows: int) -> None:
    native.run_in_chunks(lambda r0, r1, _: call(r0, r1), rows, native.chunk_count(rows, MIN_ROWS_PER_CHUNK))


def softmax_pair(z: torch.Tensor) -> torch.Tensor:
    """[softmax(z), softmax(-z)] over the last axis of z [..., d]: [..., 2 d]; native where ``applies(z)`` and d
    is a multiple of ``lanes()``."""
    d = z.shape[-1]
    if not (takes(z) and d % lanes() == 0):
        return softmax_pair_reference(z)
    if torch.compiler.is_compiling():
        return torch.ops.luna_convert.softmax_pair(z)
    return _native_softmax_pair(z)


def _native_softmax_pair(z: torch.Tensor) -> torch.Tensor:
    d = z.shape[-1]
    out = torch.empty(*z.shape[:-1], 2 * d, dtype=torch.float32)  # not the default dtype: C writes floats
    lib = library()
    _over_rows(lambda r0, r1: lib.softmax_pair_forward(z=z.data_ptr(), r0=r0, r1=r1, d=d, y=out.data_ptr()), z.numel() // d)
    return out


def softmax_pair_rows(logits: ProducedRows) -> ProducedRows:
    """``softmax_pair`` of the logits that ``logits`` makes ([..., d], d a multiple of ``lanes()``), itself made a
    block of tokens at a time inside the core's products (``ops.products.ProducedRows``; Hedgehog's features):
    the same values to the bit as ``softmax_pair`` of the stored logits. Native only: check ``applies`` and
    ``lanes()`` first."""
    d = logits.shape[-1]
    return ProducedRows("softmax_pair_rows", (*logits.shape[:-1], 2 * d), (), (d,), source=logits)


def _build_softmax_pair_rows(tensors, ints, floats, source: BuiltRows) -> BuiltRows:
    return made(library(), "softmax_pair_rows", (source,), logits=source.function, logits_state=source.address,
                d=ints[0])


def exp_minus_row_max_rows(logits: ProducedRows, offset: float = 0.0) -> ProducedRows:
    """``exp_minus_row_max_`` of the logits that ``logits`` makes, itself made a block of tokens at a time inside the
    core's products (Performer's and Flexformer's query features): the same values to the bit as that function
    on the stored logits. Native only: check ``library()`` first."""
    return ProducedRows("exp_minus_max_rows", logits.shape, (), (logits.shape[-1],), (offset,), source=logits)


def _build_exp_minus_max_rows(tensors, ints, floats, source: BuiltRows) -> BuiltRows:
    return made(library(), "exp_minus_max_rows", (source,), logits=source.function, logits_state=source.address,
                width=ints[0], offset=floats[0])


def positive_key_rows(logits: ProducedRows, x: torch.Tensor, norm_scale: float, offset: float,
                      mask: torch.Tensor | None = None) -> ProducedRows:
    """Positive random features of keys, exp(logit - |x|^2 c - shift) with ``norm_scale`` = -c, made a block of
    tokens at a time inside the core's products from the logits that ``logits`` makes (the scaled W x of keys x
    [B, H, N, d]), and 0 for pad keys (``mask`` [B, N], True = real). The shift, one per example and head, is
    the largest logit - |x|^2 c over real keys plus ``offset``: computed here first, in a pass of its own over
    the same logits (``positive_key_shift``), never stored. Native only: check ``library()`` first."""
    b, h, n, _ = x.shape
    width = logits.shape[-1]
    return ProducedRows("positive_key_rows", (b, h, n, width), (x, mask), (width,), (norm_scale, offset), source=logits)


def _build_positive_key_rows(tensors, ints, floats, source: BuiltRows) -> BuiltRows:
    """The key rows' state, and its shift from a pass of its own over the logits (before any product reads it)."""
    x, mask = tensors
    b, h, n, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    shift = torch.empty(b * h, dtype=torch.float32)
    keep = (source, x, shift)
    mask_pointer = 0
    if mask is not None:
        mask = mask.to(torch.uint8).contiguous()  # [B, N], one byte a key
        keep, mask_pointer = (*keep, mask), mask.data_ptr()
    lib = library()
    rows = made(lib, "positive_key_rows", keep, logits=source.function, logits_state=source.address, x=x.data_ptr(),
                heads=h, stride_b=x.stride(0), stride_h=x.stride(1), stride_n=x.stride(2), depth=d, width=ints[0],
                norm_scale=floats[0], offset=floats[1], mask=mask_pointer, mask_stride_b=n, shift=shift.data_ptr())
    native.run_in_chunks(lambda b0, b1, _: lib.positive_key_shift(s=rows.address, b0=b0, b1=b1, n=n,
                                                                  shift=shift.data_ptr()),
                         b * h, native.chunk_count(b * h, 1))
    return rows


def pointwise_feature_rows(x: torch.Tensor, kind: str, trig: torch.Tensor | None = None) -> ProducedRows:
    """The fixed elementwise features of x [B, H, N, w] (float32, any strides but a last of 1) as
    ``ops.products.ProducedRows``, made a block of tokens at a time inside the core's products and never
    stored: "relu" relu(x) (ReLU's map), "elu" elu(x) + 1 computed as exp(x - relu(x)) + relu(x) (ELU's map), or
    "cosformer" [relu(x) sin, relu(x) cos] [B, H, N, 2 w] with (sin, cos) per token from ``trig`` [B or 1, N, 2]
    (cosFormer's map without prefix tokens). The same values to the bit as the maps' forwards, but for elu's
    exp (to float32 rounding). Native only: check ``library()`` first; no gradients."""
    b, h, n, width = x.shape
    if kind == "cosformer":
        if trig is None or trig.dtype != torch.float32 or trig.shape[-2:] != (n, 2) or trig.shape[0] not in (1, b):
            raise ValueError(f"cosformer rows need a float32 trig table [1 or {b}, {n}, 2]; got "
                             f"{None if trig is None else (trig.dtype, tuple(trig.shape))}")
    else:
        trig = None
    shape = (b, h, n, 2 * width if kind == "cosformer" else width)
    return ProducedRows("pointwise_rows", shape, (x, trig), (POINTWISE_KINDS[kind],))


def _build_pointwise_rows(tensors, ints, floats, source) -> BuiltRows:
    x, trig = tensors
    _, h, n, width = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    keep, trig_pointer, trig_stride = (x,), 0, 0
    if trig is not None:
        trig = trig.contiguous()
        keep, trig_pointer, trig_stride = (x, trig), trig.data_ptr(), (2 * n if trig.shape[0] > 1 else 0)
    return made(library(), "pointwise_rows", keep, x=x.data_ptr(), heads=h, stride_b=x.stride(0), stride_h=x.stride(1),
                stride_n=x.stride(2), width=width, kind=ints[0], trig=trig_pointer, trig_stride_b=trig_stride)


products.register_maker("softmax_pair_rows", (0, 1, 0), _build_softmax_pair_rows)
products.register_maker("exp_minus_max_rows", (0, 1, 1), _build_exp_minus_max_rows)
products.register_maker("positive_key_rows", (2, 1, 2), _build_positive_key_rows)
products.register_maker("pointwise_rows", (2, 1, 0), _build_pointwise_rows)


def softmax_pair_reference(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


def softmax_pair_backward(features: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """z's gradient from y = softmax_pair(z) [..., 2 d] and y's gradient: y+ (g+ - g+.y+) - y- (g- - g-.y-)."""
    d = features.shape[-1] // 2
    grad = grad.contiguous()
    if not (takes(features, grad) and d % lanes() == 0):
        return softmax_pair_backward_reference(features, grad)
    if torch.compiler.is_compiling():
        return torch.ops.luna_convert.softmax_pair_backward(features, grad)
    return _native_softmax_pair_backward(features, grad)


def _native_softmax_pair_backward(features: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    d = features.shape[-1] // 2
    grad_z = torch.empty(*features.shape[:-1], d, dtype=torch.float32)
    lib = library()
    _over_rows(lambda r0, r1: lib.softmax_pair_backward(y=features.data_ptr(), g=grad.data_ptr(), r0=r0, r1=r1, d=d,
                                                        gz=grad_z.data_ptr()), grad_z.numel() // d)
    return grad_z


def softmax_pair_backward_reference(features: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    (pos, neg), (grad_pos, grad_neg) = features.chunk(2, -1), grad.chunk(2, -1)
    return (pos * (grad_pos - (grad_pos * pos).sum(-1, keepdim=True))
            - neg * (grad_neg - (grad_neg * neg).sum(-1, keepdim=True)))


def exp_minus_row_max_(x: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """x = exp(x - max over x's last axis - offset), in place; returns x."""
    if not applies(x):
        return exp_minus_row_max_reference_(x, offset)
    width, lib = x.shape[-1], library()
    _over_rows(lambda r0, r1: lib.exp_minus_row_max(x=x.data_ptr(), r0=r0, r1=r1, width=width, offset=offset), x.numel() // max(width, 1))
    return x


def exp_minus_row_max_reference_(x: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    return x.sub_(x.amax(-1, keepdim=True).add_(offset)).exp_()


def exp_minus_shift_(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x = exp(x - shift), in place, for x [G, R, W] and one shift per group, [G] (any shape of G elements);
    returns x."""
    shift = shift.reshape(-1)
    if not (x.dim() == 3 and applies(x, shift) and shift.numel() == x.shape[0]):
        return exp_minus_shift_reference_(x, shift)
    groups, rows, width = x.shape
    lib = library()
    _over_rows(lambda r0, r1: lib.exp_minus_shift(x=x.data_ptr(), r0=r0, r1=r1, width=width, shift=shift.data_ptr(),
                                                  rows_per_shift=rows), groups * rows)
    return x


def exp_minus_shift_reference_(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return x.sub_(shift.reshape(-1, 1, 1)).exp_()


# The native exps as registered operators (schema, fake output, autograd for the softmax pair): what compiled
# and exported graphs call. Each takes any layout a graph hands it (a contiguous copy where it must).
@torch.library.custom_op("luna_convert::softmax_pair", mutates_args=(), device_types="cpu")
def softmax_pair_op(z: torch.Tensor) -> torch.Tensor:
    """[softmax(z), softmax(-z)] over the last axis, natively."""
    z = z.contiguous()
    return _native_softmax_pair(z) if z.shape[-1] % lanes() == 0 else softmax_pair_reference(z)


@softmax_pair_op.register_fake
def _softmax_pair_shape(z):
    return z.new_empty((*z.shape[:-1], 2 * z.shape[-1]))


@torch.library.custom_op("luna_convert::softmax_pair_backward", mutates_args=(), device_types="cpu")
def softmax_pair_backward_op(features: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """z's gradient from the softmax pair's features and their gradient, natively."""
    features, grad = features.contiguous(), grad.contiguous()
    if (features.shape[-1] // 2) % lanes():
        return softmax_pair_backward_reference(features, grad).contiguous()
    return _native_softmax_pair_backward(features, grad)


@softmax_pair_backward_op.register_fake
def _softmax_pair_backward_shape(features, grad):
    return features.new_empty((*features.shape[:-1], features.shape[-1] // 2))


def _softmax_pair_context(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_pair_gradient(ctx, grad):
    (features,) = ctx.saved_tensors
    return softmax_pair_backward_op(features, grad)


softmax_pair_op.register_autograd(_softmax_pair_gradient, setup_context=_softmax_pair_context)



@torch.library.custom_op("luna_convert::stabilised_exp", mutates_args=(), device_types="cpu")
def stabilised_exp_op(x: torch.Tensor, shift: torch.Tensor | None, offset: float) -> torch.Tensor:
    """exp(x - shift) for x [G, R, W] and one shift per group (``exp_minus_shift_``), or with ``shift`` None
    exp(x - its row's max - offset) (``exp_minus_row_max_``), natively, into a fresh tensor: what compiled
    graphs call for the random features' exps (eager code runs the in-place passes on its own logits)."""
    out = x.clone(memory_format=torch.contiguous_format)  # one copy, whatever x's layout
    return exp_minus_row_max_(out, offset) if shift is None else exp_minus_shift_(out, shift.contiguous())


def stabilised_exp_reference(x: torch.Tensor, shift: torch.Tensor | None, offset: float) -> torch.Tensor:
    """``luna_convert::stabilised_exp`` in PyTorch ops (its reference); the max, a stabiliser, held fixed."""
    if shift is None:
        return (x - x.amax(-1, keepdim=True).detach() - offset).exp()
    return (x - shift.reshape(-1, 1, 1)).exp()


@stabilised_exp_op.register_fake
def _stabilised_exp_shape(x, shift, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _stabilised_exp_context(ctx, inputs, output):
    ctx.save_for_backward(output)


def _stabilised_exp_gradient(ctx, grad):
    """The shift (a stabiliser that cancels in the normalised weights) passes no gradient: grad * features."""
    (features,) = ctx.saved_tensors
    return grad * features, None, None


stabilised_exp_op.register_autograd(_stabilised_exp_gradient, setup_context=_stabilised_exp_context)
