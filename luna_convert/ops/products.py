"""The linear-attention core's batched products over tokens, x^T y (a long sum over tokens into a small
block) and x w (many token rows times a small block), with ``torch.bmm``.

Taylor's features, made inside the products a block of tokens at a time and never stored (``ProducedRows``,
from ``ops.pair_rows``), take native products (``token_products.c``) on a CPU with AVX-512 or AVX2 and FMA,
once ``ops.native`` has built the library: the made rows are a declaration (the maker's name, the tensors,
ints and floats it reads), and in compiled and exported graphs one operator per product
(``luna_convert::produced_product``, ``luna_convert::produced_transposed_product``) takes that declaration and
builds the maker's C state inside, from the tensors of the run: a schema cannot hold a function pointer, and a
data pointer or stride taken while tracing would be stale when the graph runs. Eager code builds the same
state and calls C. Their sums round as fused multiply-adds in their own order: equal to ``torch.bmm`` of the
stored features to float32 rounding, not to the bit.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from . import native
from .dtypes import records_grad

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
    lead, x3, y3 = x.shape[:-2], _flat(x), _flat(y)
    out = torch.bmm(x3.transpose(1, 2), y3)
    if with_sum:
        out = torch.cat([out, x3.sum(1).unsqueeze_(-1)], -1)
    return _unflat(out, lead)


def product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x w for x [..., N, D] and w [..., D, e]: [..., N, e]; with a ``bias`` [..., 1, e], x w + bias."""
    lead = x.shape[:-2]
    out = torch.bmm(_flat(x), _flat(w)) if bias is None else torch.baddbmm(_flat(bias), _flat(x), _flat(w))
    return _unflat(out, lead)


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
    and ``floats`` are what it reads. The state and the function pointer are built from the tensors when a
    product runs (``built``): by eager code just before its C call, and inside the operators
    ``luna_convert::produced_product`` and ``luna_convert::produced_transposed_product`` in compiled and exported
    graphs, from the tensors the graph hands them then, so that no data pointer, stride or function address is
    ever a constant of a graph (a schema cannot hold a pointer)."""

    maker: str
    shape: tuple
    tensors: tuple = ()
    ints: tuple = ()
    floats: tuple = ()

    def arguments(self) -> tuple[str, list, list, list]:
        """(maker, tensors, ints, floats): the declaration as the operators take it (``build_rows`` reads it)."""
        return self.maker, list(self.tensors), list(self.ints), list(self.floats)

    def built(self) -> BuiltRows:
        return build_rows(*self.arguments())


def made(lib: native.NativeFunctions, maker: str, keep: tuple, **state_args) -> BuiltRows:
    """The C function ``maker`` of ``lib`` with its state, a buffer of ``<maker>_state_size()`` bytes set by
    ``<maker>_state(s=state, **state_args)`` (the convention of every maker)."""
    state = ctypes.create_string_buffer(getattr(lib, f"{maker}_state_size")())
    getattr(lib, f"{maker}_state")(s=state, **state_args)
    return BuiltRows(getattr(lib, maker).address, state, tuple(keep))


# name -> build(tensors, ints, floats) -> BuiltRows
_MAKERS: dict = {}


def register_maker(name: str, build) -> None:
    """Declare the C maker ``name``: ``build`` makes its ``BuiltRows`` from its tensors, ints and floats. It must
    take every data pointer and stride from the tensors it is given: in a graph they are the run's."""
    _MAKERS[name] = build


def build_rows(maker: str, tensors, ints, floats) -> BuiltRows:
    """The ``BuiltRows`` of a declaration (``ProducedRows.arguments``)."""
    if maker not in _MAKERS:
        raise KeyError(f"no row maker {maker!r} registered (import the module that defines it)")
    return _MAKERS[maker](list(tensors), list(ints), list(floats))


def produced_rows_apply(*tensors: torch.Tensor) -> bool:
    """Whether a map may hand these (its inputs and parameters) to the products as ``ProducedRows``: float32
    CPU tensors, no gradient recorded for any, no autocast, and the native products here. Compiled and exported
    graphs call the made-rows operators."""
    return (all([t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors])
            and not records_grad(*tensors)
            and not torch.is_autocast_enabled("cpu") and native_available())


def _check_produced(shape: tuple, other: torch.Tensor, what: str) -> None:
    """The operand that goes with rows of ``shape``: float32 on the CPU, their leading shape, unit column stride."""
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


# The products of made rows as registered operators. The maker travels as a declaration (its name, the
# tensors it reads, its ints and floats: ``ProducedRows.arguments``) and is built inside the operator, from
# the tensors of the run. Inference only: a gradient through them is refused where autograd would record one.
@torch.library.custom_op("luna_convert::produced_product", mutates_args=(), device_types="cpu")
def produced_product_op(w: torch.Tensor, shape: list[int], maker: str, tensors: list[torch.Tensor],
                        ints: list[int], floats: list[float]) -> torch.Tensor:
    """x w for the x [*shape] that ``maker`` makes, natively."""
    w = w if w.stride(-1) == 1 else w.contiguous()
    return _native_produced_product(build_rows(maker, tensors, ints, floats), tuple(shape), w)


@produced_product_op.register_fake
def _produced_product_shape(w, shape, maker, tensors, ints, floats):
    return w.new_empty((*shape[:-1], w.shape[-1]))


@torch.library.custom_op("luna_convert::produced_transposed_product", mutates_args=(), device_types="cpu")
def produced_transposed_product_op(y: torch.Tensor, with_sum: bool, shape: list[int], maker: str,
                                   tensors: list[torch.Tensor], ints: list[int], floats: list[float]) -> torch.Tensor:
    """x^T y (with x's column sums when ``with_sum``) for the x [*shape] that ``maker`` makes, natively."""
    y = y if y.stride(-1) == 1 else y.contiguous()
    return _native_produced_transposed_product(build_rows(maker, tensors, ints, floats), tuple(shape), y, with_sum)


@produced_transposed_product_op.register_fake
def _produced_transposed_product_shape(y, with_sum, shape, maker, tensors, ints, floats):
    return y.new_empty((*shape[:-2], shape[-1], y.shape[-1] + int(with_sum)))


def _refuse_gradients(ctx, inputs, output):
    raise RuntimeError("the products of made rows are for inference: no gradient passes through them (a map "
                       "stores its features where autograd records one; FeatureMap.feature_rows)")


def _no_backward(ctx, grad):
    raise RuntimeError("the products of made rows have no backward")


produced_product_op.register_autograd(_no_backward, setup_context=_refuse_gradients)
produced_transposed_product_op.register_autograd(_no_backward, setup_context=_refuse_gradients)
