"""The linear-attention core's batched products over tokens, x^T y (a long sum over tokens into a small
block) and x w (many token rows times a small block), natively (``token_products.c``) where it applies and
with ``torch.bmm``, their reference, everywhere else.

Operands are [..., N, C] with one leading shape for all (callers expand first). The native code applies
to float32 CPU tensors with one or two leading axes and unit column stride, where no
gradient is recorded, on a CPU with AVX-512 or AVX2 and FMA, once ``ops.native`` has built the library.
It reads operands at any row and batch strides: the heads split from [B, N, H d] where they lie, and an
operand expanded over the batch without a copy (torch.bmm takes one batch axis, and reshaping to it
copies them). On this project's machine it runs the core's shapes (12 heads x 4,096 tokens, 64 or 128
features, 64 or 65 columns) at 1.3-1.7x ``torch.bmm``'s rate on one thread (docs/design-decisions.md,
*The core's products in native code*). Its sums round as fused multiply-adds in their own order: equal to
``torch.bmm`` to float32 rounding, not to the bit.

Features made inside the products (``ProducedRows``) are declared, not built: a chain of registered C makers
(``register_maker``) with the tensors, ints and floats each reads. In compiled and exported graphs one operator
per product of made rows (``luna_convert::produced_product``, ``luna_convert::produced_transposed_product``)
takes that declaration and builds the makers' C state inside, from the tensors of the run: a schema cannot
hold a function pointer, and a data pointer or stride taken while tracing would be stale when the graph runs.
One operator for every chain of makers, not one per maker and product, keeps one schema, fake and test for
all of them, and a new maker is one ``register_maker`` call. Eager code builds the same state and calls C.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from . import native

NATIVE_SOURCE = Path(__file__).with_name("token_products.c")
_LAYOUT = ctypes.c_int64 * 3  # an operand's strides in floats: outer batch axis, inner batch axis, rows
# Multiply-adds per thread chunk at the least: below that a hand-off costs more than the work.
NATIVE_MIN_CHUNK = 1 << 18


def native_library() -> native.NativeFunctions | None:
    """The compiled ``token_products.c``'s functions if it has vector code for this CPU, else None."""
    lib = native.load_library(NATIVE_SOURCE)
    return lib if lib is not None and lib.product_lanes() > 0 else None


@native.constant_in_graphs
def native_available() -> bool:
    """Whether ``native_library`` gives the library; torch.compile reads it once, as a constant of the graph
    (dynamo cannot trace the library's loading: a lock and ctypes)."""
    return native_library() is not None


def native_status() -> str:
    """"on", or "off: <why>" (what the bench records beside its timings)."""
    status = native.status(NATIVE_SOURCE)
    if status == "on" and native_library() is None:
        return "off: no AVX2 with FMA or AVX-512 on this CPU"
    return status


def _native_applies(streamed: tuple[torch.Tensor, ...], small: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether the native code takes these: ``streamed`` operands as they are (unit column stride), and
    ``small`` ones, which it takes as contiguous copies where they are not; all of one leading shape (the C
    code reads every operand at the first one's batch entries). In compiled and exported graphs too, where
    the registered operators below stand for the native calls (their implementation checks the strides
    again at run time: a graph may hand them other layouts than the ones it was traced with)."""
    tensors = (*streamed, *small)
    lead = streamed[0].shape[:-2]
    # Lists, not generators: dynamo fails closing a generator that all() or any() left unfinished.
    return (all([t.dim() in (3, 4) and t.shape[:-2] == lead and t.device.type == "cpu" and t.dtype == torch.float32
                 for t in tensors])
            and all([t.stride(-1) == 1 for t in streamed])
            and not (torch.is_grad_enabled() and any([t.requires_grad for t in tensors]))
            and native_available())


def _layout(t: torch.Tensor):
    """``t`` [B, H, R, C] or [H, R, C] as the C code's {outer, inner, row} strides."""
    return _LAYOUT(*t.stride()[:3]) if t.dim() == 4 else _LAYOUT(0, *t.stride()[:2])


def _run(function, batch: int, work_per_entry: int) -> None:
    """``function(b0, b1)`` over the batch entries, in thread chunks (``ops.native.run_in_chunks``)."""
    chunks = native.chunk_count(batch, max(1, NATIVE_MIN_CHUNK // max(1, work_per_entry)))
    native.run_in_chunks(lambda b0, b1, _: function(b0, b1), batch, chunks)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[..., R, C] as [-1, R, C] for torch.bmm (a copy where the leading axes do not merge)."""
    return t if t.dim() == 3 else t.reshape(-1, *t.shape[-2:])


def _unflat(t: torch.Tensor, lead) -> torch.Tensor:
    return t if len(lead) == 1 else t.view(*lead, *t.shape[1:])


def transposed_product(x: torch.Tensor, y: torch.Tensor, with_sum: bool = False) -> torch.Tensor:
    """x^T y for x [..., N, D] and y [..., N, e]: [..., D, e], or with ``with_sum`` [..., D, e + 1] whose last
    column is x's sum over the N tokens (``torch.cat([x^T y, x.sum(-2)[..., None]], -1)``)."""
    if not (x.shape[-2] == y.shape[-2] and _native_applies((x, y))):  # bmm says what does not match
        return transposed_product_reference(x, y, with_sum)
    if torch.compiler.is_compiling():
        return torch.ops.luna_convert.transposed_product(x, y, with_sum)
    return _native_transposed_product(x, y, with_sum)


def transposed_product_reference(x: torch.Tensor, y: torch.Tensor, with_sum: bool = False) -> torch.Tensor:
    """``transposed_product`` with torch.bmm: the reference, and the path wherever the native code does not apply."""
    lead, x3, y3 = x.shape[:-2], _flat(x), _flat(y)
    out = torch.bmm(x3.transpose(1, 2), y3)
    if with_sum:
        out = torch.cat([out, x3.sum(1).unsqueeze_(-1)], -1)
    return _unflat(out, lead)


def _native_transposed_product(x: torch.Tensor, y: torch.Tensor, with_sum: bool) -> torch.Tensor:
    if not (x.stride(-1) == y.stride(-1) == 1 and x.shape[:-2] == y.shape[:-2]):
        return transposed_product_reference(x, y, with_sum)
    *lead, n, depth = x.shape
    columns, inner = y.shape[-1], x.shape[-3]
    out = torch.empty(*lead, depth, columns + with_sum, dtype=torch.float32)  # not the default dtype: C writes floats
    lib, layouts = native_library(), (_layout(x), _layout(y), _layout(out))
    _run(lambda b0, b1: lib.transposed_product(x=x.data_ptr(), y=y.data_ptr(), c=out.data_ptr(), b0=b0, b1=b1,
                                               inner=inner, n=n, depth=depth, columns=columns, with_sum=int(with_sum),
                                               sx=layouts[0], sy=layouts[1], sc=layouts[2]),
         math.prod(lead), n * depth * columns)
    return out


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x w for x [..., N, D] and w [..., D, e]: [..., N, e]; with a ``bias`` [..., 1, e], x w + bias."""
    small = (w,) if bias is None else (w, bias)
    shapes_match = x.shape[-1] == w.shape[-2] and (bias is None or bias.shape[-2:] == (1, w.shape[-1]))
    if not (shapes_match and _native_applies((x,), small)):  # bmm says what does not match
        return product_reference(x, w, bias)
    if torch.compiler.is_compiling():
        return torch.ops.luna_convert.product(x, w, bias)
    return _native_product(x, w, bias)


def product_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``product`` with torch.bmm (baddbmm): the reference, and the path wherever the native code does not apply."""
    lead = x.shape[:-2]
    out = torch.bmm(_flat(x), _flat(w)) if bias is None else torch.baddbmm(_flat(bias), _flat(x), _flat(w))
    return _unflat(out, lead)


def _native_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.stride(-1) != 1 or x.shape[:-2] != w.shape[:-2] or (bias is not None and bias.shape[:-2] != x.shape[:-2]):
        return product_reference(x, w, bias)
    *lead, n, depth = x.shape
    columns, inner = w.shape[-1], x.shape[-3]
    w = w if w.stride(-1) == 1 else w.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    out = torch.empty(*lead, n, columns, dtype=torch.float32)
    lib = native_library()
    layouts = (_layout(x), _layout(w), _layout(bias) if bias is not None else _LAYOUT(0, 0, 0), _layout(out))
    bias_pointer = 0 if bias is None else bias.data_ptr()
    _run(lambda b0, b1: lib.product(x=x.data_ptr(), w=w.data_ptr(), bias=bias_pointer, c=out.data_ptr(), b0=b0, b1=b1,
                                    inner=inner, n=n, depth=depth, columns=columns, sx=layouts[0], sw=layouts[1],
                                    sbias=layouts[2], sc=layouts[3]),
         math.prod(lead), n * depth * columns)
    return out


# The native products as registered operators (torch.library), what compiled and exported graphs call: a
# schema, a fake implementation (the output's shape) and autograd, so that Inductor keeps them in the graph
# as opaque calls and torch.export shows them. Eager code calls the same implementations directly: the
# dispatcher's round trip would add its overhead to every call for nothing.
@torch.library.custom_op("luna_convert::transposed_product", mutates_args=(), device_types="cpu")
def transposed_product_op(x: torch.Tensor, y: torch.Tensor, with_sum: bool) -> torch.Tensor:
    """x^T y (with x's column sums appended when ``with_sum``), natively."""
    return _native_transposed_product(x, y, with_sum)


@transposed_product_op.register_fake
def _transposed_product_shape(x, y, with_sum):
    return x.new_empty((*x.shape[:-2], x.shape[-1], y.shape[-1] + int(with_sum)))


def _transposed_product_context(ctx, inputs, output):
    x, y, with_sum = inputs
    ctx.save_for_backward(x, y)
    ctx.with_sum = with_sum


def _transposed_product_backward(ctx, grad):
    """x^T y's gradients through the operators themselves (traced graphs hold no native call otherwise):
    y g^T for x, x g for y, where g is the gradient of the product's columns."""
    x, y = ctx.saved_tensors
    columns = y.shape[-1]
    grad_xy = grad[..., :columns]
    grad_x = product_op(y, grad_xy.transpose(-1, -2).contiguous(), None) if ctx.needs_input_grad[0] else None
    if grad_x is not None and ctx.with_sum:  # the sum column: each token's row gets the column's gradient
        grad_x = grad_x + grad[..., columns].unsqueeze(-2)
    grad_y = product_op(x, grad_xy.contiguous(), None) if ctx.needs_input_grad[1] else None  # x g   [..., N, e]
    return grad_x, grad_y, None


transposed_product_op.register_autograd(_transposed_product_backward, setup_context=_transposed_product_context)


@torch.library.custom_op("luna_convert::product", mutates_args=(), device_types="cpu")
def product_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x w (+ bias), natively."""
    return _native_product(x, w, bias)


@product_op.register_fake
def _product_shape(x, w, bias):
    return x.new_empty((*x.shape[:-1], w.shape[-1]))


def _product_context(ctx, inputs, output):
    x, w, bias = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = bias is not None


def _product_backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad_x = product_op(grad.contiguous(), w.transpose(-1, -2).contiguous(), None) if ctx.needs_input_grad[0] else None
    grad_w = transposed_product_op(x, grad.contiguous(), False) if ctx.needs_input_grad[1] else None  # x^T g
    grad_bias = grad.sum(-2, keepdim=True) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_bias


product_op.register_autograd(_product_backward, setup_context=_product_context)


@dataclass(frozen=True)
class BuiltRows:
    """A maker ready to run: the address of a C function ``void f(const void *state, int64_t b, int64_t t0, int64_t
    tn, float *out)`` that writes the rows [t0, t0 + tn) of batch entry b (b = batch index x H + head) to out as a
    contiguous [tn, D], for any b and block; ``state`` (a ctypes buffer) its first argument, and ``keep`` the
    tensors that state points into, held alive as long as this is."""

    function: int
    state: object
    keep: tuple = ()

    @property
    def address(self) -> int:
        return ctypes.addressof(self.state)


@dataclass(frozen=True)
class ProducedRows:
    """An operand x [B, H, N, D] (or [H, N, D]) that the native products make a block of tokens at a time, in
    cache, instead of reading it from memory: a map's features (``FeatureMap.feature_rows``), which then never
    go to memory at all.

    A declaration, not C state: ``maker`` names a registered C maker (``register_maker``), ``tensors``, ``ints``
    and ``floats`` are what it reads, and ``source`` the rows another maker makes for it (Hedgehog's logits for
    its softmax pair). The state and the function pointer are built from the tensors when a product runs
    (``built``): by eager code just before its C call, and inside the operators ``luna_convert::produced_product``
    and ``luna_convert::produced_transposed_product`` in compiled and exported graphs, from the tensors the graph
    hands them then, so that no data pointer, stride or function address is ever a constant of a graph (a schema
    cannot hold a pointer)."""

    maker: str
    shape: tuple
    tensors: tuple = ()
    ints: tuple = ()
    floats: tuple = ()
    source: "ProducedRows | None" = None

    def chain(self) -> list["ProducedRows"]:
        """This rows' makers, the innermost (the one that reads memory) first."""
        return ([] if self.source is None else self.source.chain()) + [self]

    def arguments(self) -> tuple[str, list, list, list]:
        """(makers, tensors, ints, floats): the chain as the operators take it (``build_rows`` reads it back)."""
        chain = self.chain()
        return (",".join([rows.maker for rows in chain]), [t for rows in chain for t in rows.tensors],
                [i for rows in chain for i in rows.ints], [f for rows in chain for f in rows.floats])

    def built(self) -> BuiltRows:
        return build_rows(*self.arguments())


def made(lib: native.NativeFunctions, maker: str, keep: tuple, **state_args) -> BuiltRows:
    """The C function ``maker`` of ``lib`` with its state, a buffer of ``<maker>_state_size()`` bytes set by
    ``<maker>_state(s=state, **state_args)`` (the convention of every maker)."""
    state = ctypes.create_string_buffer(getattr(lib, f"{maker}_state_size")())
    getattr(lib, f"{maker}_state")(s=state, **state_args)
    return BuiltRows(getattr(lib, maker).address, state, tuple(keep))


# name -> (build(tensors, ints, floats, source BuiltRows or None) -> BuiltRows, (tensors, ints, floats) it reads)
_MAKERS: dict[str, tuple] = {}


def register_maker(name: str, counts: tuple[int, int, int], build) -> None:
    """Declare the C maker ``name``: ``build`` makes its ``BuiltRows`` from ``counts`` tensors (None where one is
    optional), ints and floats, and from its source's ``BuiltRows`` (None for a maker that reads memory). It
    must take every data pointer and stride from the tensors it is given: in a graph they are the run's."""
    _MAKERS[name] = (build, tuple(counts))


def build_rows(makers: str, tensors, ints, floats) -> BuiltRows:
    """The ``BuiltRows`` of a chain of makers (``ProducedRows.arguments``), the innermost first, each the
    source of the next."""
    built, at = None, (0, 0, 0)
    for name in makers.split(","):
        if name not in _MAKERS:
            raise KeyError(f"no row maker {name!r} registered (import the module that defines it)")
        build, counts = _MAKERS[name]
        parts = [list(values[a:a + c]) for values, a, c in zip((tensors, ints, floats), at, counts)]
        at = tuple(a + c for a, c in zip(at, counts))
        built = build(*parts, built)
    if at != (len(tensors), len(ints), len(floats)):
        raise ValueError(f"the makers {makers} read {at} tensors, ints and floats, given "
                         f"{(len(tensors), len(ints), len(floats))}")
    return built


def produced_rows_apply(*tensors: torch.Tensor) -> bool:
    """Whether a map may hand these (its inputs and parameters) to the products as ``ProducedRows``: float32
    CPU tensors, no gradient recorded for any, no autocast, and the native products here. Compiled and exported
    graphs call the made-rows operators."""
    return (all([t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors])
            and not (torch.is_grad_enabled() and any([t.requires_grad for t in tensors]))
            and not torch.is_autocast_enabled("cpu") and native_available())


def _check_produced(shape: tuple, other: torch.Tensor, what: str) -> None:
    """The checks ``_native_applies`` makes for a read operand, for the one that goes with rows of ``shape``."""
    if not native_available():
        raise RuntimeError(f"produced rows need the native products ({native_status()})")
    lead = tuple(shape[:-2])
    if len(shape) not in (3, 4) or tuple(other.shape[:-2]) != lead or other.dtype != torch.float32 \
            or other.device.type != "cpu" or other.stride(-1) != 1:
        raise ValueError(f"{what} must be float32 on the CPU, [{', '.join(map(str, lead))}, ...] with unit "
                         f"column stride, for rows {tuple(shape)}; got {other.dtype} {tuple(other.shape)}")


def produced_transposed_product(rows: ProducedRows, y: torch.Tensor, with_sum: bool = False) -> torch.Tensor:
    """``transposed_product(x, y, with_sum)`` for the x that ``rows`` makes (native code only, no gradients)."""
    _check_produced(rows.shape, y, "y")
    if y.shape[-2] != rows.shape[-2]:
        raise ValueError(f"y has {y.shape[-2]} tokens, the rows {rows.shape[-2]}")
    if torch.compiler.is_compiling():
        return torch.ops.luna_convert.produced_transposed_product(y, with_sum, list(rows.shape), *rows.arguments())
    return _native_produced_transposed_product(rows.built(), tuple(rows.shape), y, with_sum)


def _native_produced_transposed_product(rows: BuiltRows, shape: tuple, y: torch.Tensor, with_sum: bool) -> torch.Tensor:
    *lead, n, depth = shape
    columns, inner = y.shape[-1], shape[-3]
    out = torch.empty(*lead, depth, columns + with_sum, dtype=torch.float32)
    lib, layouts = native_library(), (_layout(y), _layout(out))
    _run(lambda b0, b1: lib.produced_transposed_product(
        produce=rows.function, state=rows.address, y=y.data_ptr(), c=out.data_ptr(), b0=b0, b1=b1, inner=inner, n=n,
        depth=depth, columns=columns, with_sum=int(with_sum), sy=layouts[0], sc=layouts[1]),
         math.prod(lead), n * depth * columns)
    return out


def produced_product(rows: ProducedRows, w: torch.Tensor) -> torch.Tensor:
    """``product(x, w)`` for the x that ``rows`` makes (native code only, no gradients)."""
    w = w if w.stride(-1) == 1 else w.contiguous()
    _check_produced(rows.shape, w, "w")
    if w.shape[-2] != rows.shape[-1]:
        raise ValueError(f"w has {w.shape[-2]} rows, the produced rows {rows.shape[-1]} columns")
    if torch.compiler.is_compiling():
        return torch.ops.luna_convert.produced_product(w, list(rows.shape), *rows.arguments())
    return _native_produced_product(rows.built(), tuple(rows.shape), w)


def _native_produced_product(rows: BuiltRows, shape: tuple, w: torch.Tensor) -> torch.Tensor:
    *lead, n, depth = shape
    columns, inner = w.shape[-1], shape[-3]
    out = torch.empty(*lead, n, columns, dtype=torch.float32)
    lib, layouts = native_library(), (_layout(w), _layout(out))
    _run(lambda b0, b1: lib.produced_product(produce=rows.function, state=rows.address, w=w.data_ptr(),
                                             c=out.data_ptr(), b0=b0, b1=b1, inner=inner, n=n, depth=depth,
                                             columns=columns, sw=layouts[0], sc=layouts[1]),
         math.prod(lead), n * depth * columns)
    return out


# The products of made rows as registered operators. The makers travel as a declaration (their names, the
# tensors they read, their ints and floats: ``ProducedRows.arguments``) and are built inside the operator, from
# the tensors of the run. Inference only: a gradient through them is refused where autograd would record one.
@torch.library.custom_op("luna_convert::produced_product", mutates_args=(), device_types="cpu")
def produced_product_op(w: torch.Tensor, shape: list[int], makers: str, tensors: list[torch.Tensor | None],
                        ints: list[int], floats: list[float]) -> torch.Tensor:
    """x w for the x [*shape] that the chain ``makers`` makes, natively."""
    w = w if w.stride(-1) == 1 else w.contiguous()
    return _native_produced_product(build_rows(makers, tensors, ints, floats), tuple(shape), w)


@produced_product_op.register_fake
def _produced_product_shape(w, shape, makers, tensors, ints, floats):
    return w.new_empty((*shape[:-1], w.shape[-1]))


@torch.library.custom_op("luna_convert::produced_transposed_product", mutates_args=(), device_types="cpu")
def produced_transposed_product_op(y: torch.Tensor, with_sum: bool, shape: list[int], makers: str,
                                   tensors: list[torch.Tensor | None], ints: list[int],
                                   floats: list[float]) -> torch.Tensor:
    """x^T y (with x's column sums when ``with_sum``) for the x [*shape] that the chain ``makers`` makes, natively."""
    y = y if y.stride(-1) == 1 else y.contiguous()
    return _native_produced_transposed_product(build_rows(makers, tensors, ints, floats), tuple(shape), y, with_sum)


@produced_transposed_product_op.register_fake
def _produced_transposed_product_shape(y, with_sum, shape, makers, tensors, ints, floats):
    return y.new_empty((*shape[:-2], shape[-1], y.shape[-1] + int(with_sum)))


def _refuse_gradients(ctx, inputs, output):
    raise RuntimeError("the products of made rows are for inference: no gradient passes through them (a map "
                       "stores its features where autograd records one; FeatureMap.feature_rows)")


def _no_backward(ctx, grad):
    raise RuntimeError("the products of made rows have no backward")


produced_product_op.register_autograd(_no_backward, setup_context=_refuse_gradients)
produced_transposed_product_op.register_autograd(_no_backward, setup_context=_refuse_gradients)


def affine_feature_rows(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, relu: bool) -> ProducedRows:
    """relu(x W^T + b) (or x W^T + b) for x [B, H, N, d] (float32, any strides but a last of 1), W^T [d, D] and
    b [D], or one per head ([H, d, D] and [H, D]), as ``ProducedRows`` [B, H, N, D]: made in the products,
    never stored (T2R's map; Hedgehog's logits, ``exp_rows.softmax_pair_rows``). The same values to the bit
    as ``product(x, W^T, b)``. No gradients."""
    b, h, n, _ = x.shape
    return ProducedRows("affine_rows", (b, h, n, weight_t.shape[-1]), (x, weight_t, bias), (int(relu),))


def _build_affine_rows(tensors, ints, floats, source) -> BuiltRows:
    x, weight_t, bias = tensors
    _, h, _, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight_t, bias = weight_t.contiguous(), bias.contiguous()
    columns, per_head = weight_t.shape[-1], weight_t.dim() == 3
    return made(native_library(), "affine_rows", (x, weight_t, bias), x=x.data_ptr(), heads=h, stride_b=x.stride(0),
                stride_h=x.stride(1), stride_n=x.stride(2), depth=d, columns=columns, wt=weight_t.data_ptr(),
                bias=bias.data_ptr(), weight_head=d * columns if per_head else 0,
                bias_head=columns if per_head else 0, relu=ints[0])


register_maker("affine_rows", (3, 1, 0), _build_affine_rows)
