"""LUNA's scalar channel bank evaluated from its knots (``scalar_channels``; the reference is
``luna.ScalarChannels.forward``, the MLP itself).

This is LUNA's own kernel, not a generic op: it reads the bank's four parameters (w1, b1, w2, b2)
of a 1 -> hidden -> 1 ReLU MLP, and no other method has that structure.

Every channel of the bank,

    psi_l(u) = relu( sum_h w2[l, h] * relu(w1[r, h] * u + b1[r, h]) + b2[l] ),   r = l (or 0 if shared),

is a piecewise-linear function of the scalar u. Hidden unit (r, h) switches at
its knot t = -b1 / w1: for w1 > 0 it is active (w1 u + b1 > 0) when u > t, for
w1 < 0 when u < t, and a unit with w1 == 0 is a constant, active everywhere if
b1 > 0 and nowhere otherwise. Sorting all knots of the bank (K = rows x hidden
of them, 512 with the defaults) cuts the real line into K + 1 intervals; on
interval k every channel is affine,

    inner_l(u) = slope[k, l] * u + intercept[k, l],

slope and intercept being sums of ``w2 * w1`` and ``w2 * b1`` over the units
active on that interval. The tables are built from the four parameters with
ordinary differentiable torch ops (a cumulative sum over the sorted knots,
O(K L)), so autograd carries their gradients back to the parameters.

Per token there is then one interval search per scalar (the knots of all channels are merged) and, per
channel, one gather of its slope and intercept; nothing of size ``hidden`` is ever expanded per token.

Two evaluations of the tables, the same values to float32 rounding:
- the standard-operator path, ``scalar_channels_of`` (``ops.piecewise``: the interval from a grid of the knots
  through the registered operator ``luna_convert::knot_intervals``, a grid frozen into an exported graph by
  ``frozen_for_export``, or a branchless binary search; then plain autograd; on the CPU without gradients, eager
  or compiled, ``piecewise_relu_features``, the tokens in chunks): what runs without a C compiler,
  with ``LUNA_CONVERT_NATIVE=0``, in float64 and half precision, on GPUs and in exported graphs;
- on the CPU in float32, where a C compiler is, ``channel_features_of`` hands the per-token part (and LUNA's
  feature norm) to ``luna_native``: one native call per map over the same tables and its own grid (built with
  the native cell arithmetic, ``KnotLocator``); compiled graphs call it as the registered operators below.
  It stays because it is 2.2x faster and half the memory of the standard path (docs/benchmarks.md, *Which
  native kernels stay*).

Numerics: tables are built in float64, evaluation runs in float32 (float64
for float64 inputs) with autocast disabled, and the result has the input's
dtype. At a knot exactly (u == t, a set of measure zero) the value is the same
as the reference's; the subgradient for the parameters of a decreasing unit
(w1 < 0) counts the unit as active there, where ``torch.relu`` would count it
as inactive.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import weakref
from typing import Callable

import torch

from ..ops.dtypes import accumulation_dtype, records_grad
from ..ops.normalize import sum_normalize
from ..ops.piecewise import KnotGrid, binary_search, knot_intervals, piecewise_relu_channels, piecewise_relu_features
from ..ops.streamed import current_recompute_scope
from . import luna_native
from .luna_native import native_projected_channel_features, native_cells, native_channel_features

# Grid locator: at most this many knots may share a cell (else a finer grid, then searchsorted).
MAX_KNOTS_PER_CELL = 4
MAX_CELLS = 1 << 17
# Key of the channel tables in a streamed backward's recompute scope.
TABLES_KEY = "luna-channel-tables"


def channel_tables(psi, dtype: torch.dtype = torch.float64, scale: float = 1.0):
    """Knots and per-interval affine pieces of the channel bank ``psi``: ``(knots, slope, intercept)``,
    the two halves of :func:`piecewise_table`'s table."""
    knots, table = piecewise_table(psi, dtype, scale)
    channels = table.shape[1] // 2
    return knots, table[:, :channels].contiguous(), table[:, channels:].contiguous()


def piecewise_table(psi, dtype: torch.dtype = torch.float64, scale: float = 1.0):
    """Knots and per-interval affine pieces of the channel bank ``psi``.

    Returns ``(knots [K], table [K + 1, 2L])`` in ``dtype`` with K = rows * hidden;
    row k of the table is ``[slope | intercept]`` of every channel on interval k.
    ``knots`` is sorted ascending (constant units sit at +inf at the end) and
    interval k is ``knots[k-1] < u <= knots[k]``, the index
    ``torch.searchsorted(knots, u)`` returns. The table is a differentiable
    function of ``psi``'s parameters and includes the factor ``scale`` (which
    must be > 0 so that relu commutes with it).

    Below every knot the active units are the decreasing ones (w1 < 0) and the
    constant ones with b1 > 0; crossing a knot switches on its unit if w1 > 0
    and off if w1 < 0. So the table is that first row plus a cumulative sum
    over the knots in sorted order of +-(the unit's contribution): O(K L)
    work, no [K, rows, hidden] activity tensor.
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    w1, b1, w2, b2 = (p.to(dtype) for p in (psi.w1, psi.b1, psi.w2, psi.b2))
    rows, hidden = w1.shape
    channels = w2.shape[0]
    with torch.no_grad():
        sign = torch.sign(w1)
        moving = sign != 0
        safe_w1 = torch.where(moving, w1, torch.ones_like(w1))
        knot = torch.where(moving, -b1 / safe_w1, torch.full_like(w1, float("inf")))
        knots, order = knot.flatten().sort()
        first = ((sign < 0) | (~moving & (b1 > 0))).to(dtype).flatten()  # active below every knot
        step = sign.flatten()[order]  # +1 switches on, -1 off, 0 never changes
    # Contribution of unit (r, h) to the slope and the intercept of channel l: [rows * hidden, 2L]
    # (slopes first), block diagonal unless shared.
    contribution = torch.stack([w2 * w1, w2 * b1], -1)  # [L, hidden, 2]
    if rows == 1:
        unit = contribution.permute(1, 2, 0).reshape(hidden, 2 * channels)
    else:
        eye = torch.eye(channels, dtype=dtype, device=w1.device)
        unit = (contribution[..., None] * eye[:, None, None, :]).reshape(rows * hidden, 2 * channels)
    base = first @ unit + torch.cat([torch.zeros_like(b2), b2])  # [2L]
    steps = unit.index_select(0, order) * step[:, None]
    return knots, torch.cat([base[None], base + torch.cumsum(steps, 0)], 0) * scale


def _squashed_cell(x: torch.Tensor, cells: int) -> torch.Tensor:
    """A monotone non-decreasing map of floats to cells 0..cells-1 (NaN -> 0) over the whole real line.

    x / (1 + |x|) squeezes the real line into (-1, 1), so heavy-tailed knot
    sets (t = -b1/w1 of a random init is a ratio of two random numbers) still spread over the
    cells. Knots and inputs go through the very same float ops, so a knot in
    a lower cell than u is always below u, whatever the rounding.
    """
    v = x.abs().clamp_(max=1e30).add_(1)
    v = torch.div(x, v, out=v)
    v.add_(1).mul_(cells / 2).clamp_(0, cells - 1).nan_to_num_(0.0)
    return v.to(torch.int32)


def _linear_cell(x: torch.Tensor, low: float, scale: float, cells: int) -> torch.Tensor:
    """Equal cells from ``low`` on, (x - low) * scale clamped to 0..cells-1 (NaN -> 0): monotone as the
    squashed map, in 5 operator calls instead of 9, for knots that lie in a bounded range (the exp init's
    evenly spaced knots and what training makes of them)."""
    return (x - low).mul_(scale).clamp_(0, cells - 1).nan_to_num_(0.0).to(torch.int32)


def torch_cells(x: torch.Tensor, mapping: str, low: float, scale: float, cells: int) -> torch.Tensor:
    """The grid cell (int32) of every element of x: ``mapping`` "linear" ((x - low) * scale) or "squashed"."""
    return _linear_cell(x, low, scale, cells) if mapping == "linear" else _squashed_cell(x, cells)


class KnotLocator:
    """``searchsorted(knots, u)`` (number of knots < u) for a fixed sorted knot vector.

    On the CPU ``torch.searchsorted`` costs ~50 ns a scalar; a grid of cells
    does it in a few vectorised passes: index = (knots in lower cells) +
    (knots in u's cell below u), with at most ``MAX_KNOTS_PER_CELL``
    comparisons. The cells are equal from the lowest knot to the highest where that
    spreads the knots well enough, else equal in x / (1 + |x|). Falls back to
    searchsorted when knots crowd one cell of both (e.g. many identical knots).

    ``cells_of(x, mapping, low, scale, cells)`` computes cells (``torch_cells``, or the native kernel's
    own, which must then locate the inputs too: knots and inputs must take the same float operations).
    ``grid`` is (mapping, low, scale, cells, start [cells] int32, knots by cell [most, cells]), or None.
    """

    def __init__(self, knots: torch.Tensor, use_grid: bool, cells_of: Callable = torch_cells):
        self.knots, self.start, self.kpad, self.mapping, self.grid = knots, None, [], "searchsorted", None
        if not use_grid:
            return
        # Knots at +inf (constant units) are never below any u: leave them out.
        kf = knots[knots != float("inf")]
        if kf.numel() == 0:
            self._set_grid(cells_of, "linear", 0.0, 0.0, 1, torch.zeros(1, dtype=torch.int32, device=knots.device),
                           knots.new_empty(0, 1))
            return
        low, high = float(kf[0]), float(kf[-1])
        mappings = ["squashed"] if not math.isfinite(high - low) or high == low else ["linear", "squashed"]
        for mapping in mappings:
            cells = max(1024, 1 << math.ceil(math.log2(8 * kf.numel())))
            while True:
                scale = cells / (high - low) if mapping == "linear" else 0.0
                cell = cells_of(kf, mapping, low, scale, cells)
                counts = torch.bincount(cell, minlength=cells)
                most = int(counts.max())
                if most <= MAX_KNOTS_PER_CELL or cells * 8 > MAX_CELLS:
                    break
                cells *= 8
            if most <= MAX_KNOTS_PER_CELL:
                break
        else:
            return  # crowded: searchsorted
        first = torch.cumsum(counts, 0) - counts
        order = torch.argsort(cell, stable=True)
        sorted_cell = cell[order]
        slot = torch.arange(sorted_cell.numel(), device=knots.device) - first[sorted_cell]
        kpad = torch.full((most, cells), float("inf"), dtype=knots.dtype, device=knots.device)
        kpad[slot, sorted_cell] = kf[order]
        # int32: index_select takes it as fast as int64 and it halves the index's memory.
        self._set_grid(cells_of, mapping, low, scale, cells, first.to(torch.int32), kpad)

    def _set_grid(self, cells_of: Callable, mapping: str, low: float, scale: float, cells: int,
                  start: torch.Tensor, kpad: torch.Tensor) -> None:
        self.cells, self.start, self.kpad, self.mapping = cells, start, list(kpad.unbind(0)), mapping
        self.grid = (mapping, low, scale, cells, start.contiguous(), kpad.contiguous())
        self.cell_of = lambda u: cells_of(u, mapping, low, scale, cells)

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        """int32 interval index of every element of the 1-D tensor u."""
        if self.start is None:
            return torch.searchsorted(self.knots, u, out_int32=True)
        cell = self.cell_of(u)
        index = self.start.index_select(0, cell)
        # At most MAX_KNOTS_PER_CELL passes, whatever the sizes; one gather of 1-D rows each
        # (2x faster than gathering [cells, most] rows at once, CPU, measured).
        for kp in self.kpad:
            index += u > kp.index_select(0, cell)
        return index


class _CachedTables:
    """The last tables built for one channel bank outside a gradient recording, with what they were built from."""

    def __init__(self, key: tuple, params: tuple, prepared: tuple):
        self.key, self.prepared = key, prepared
        # Values, not ``_version``: edits through ``.data`` (EMA, weight surgery, some loaders) bump no version.
        self.values = tuple(p.detach().clone() for p in params)
        # Inference tensors may not be saved for backward: outside inference mode they are never handed out.
        self.inference = torch.is_inference_mode_enabled()

    def fits(self, key: tuple, params: tuple) -> bool:
        if self.key != key or (self.inference and not torch.is_inference_mode_enabled()):
            return False
        return all(_same_bits(a, b) for a, b in zip(self.values, params))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits (then the tables built from them are the same). Contiguous CPU
    tensors compare as bytes: the cache is looked up on every map call, and this adds no operator calls
    (``torch.equal`` made 4 per bank and call)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.device.type == "cpu" and a.is_contiguous() and b.is_contiguous():
        return a.numel() == 0 or ctypes.string_at(a.data_ptr(), a.nbytes) == ctypes.string_at(b.data_ptr(), b.nbytes)
    return torch.equal(a, b)


# psi -> _CachedTables: reused while the parameter values are unchanged and no gradient is being recorded
# (e.g. phi(k) right after phi(q), and every layer call at inference).
_TABLE_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _build_prepared(psi, compute: torch.dtype, scale: float, device: torch.device):
    """The native pass's ((slope, intercept), locator) in ``compute`` dtype, the locator's grid built with the
    native cell arithmetic (``luna_native.native_cells``)."""
    knots, table = _distinct_knots(*channel_table(psi, compute, scale, device))
    channels = table.shape[1] // 2
    tables = table[:, :channels].contiguous(), table[:, channels:].contiguous()
    return tables, KnotLocator(knots, True, native_cells)


def channel_table(psi, compute: torch.dtype, scale: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``piecewise_table`` of ``psi`` (times ``scale``) in ``compute`` dtype: knots [K] (detached) and table
    [K + 1, 2L] (differentiable), built in float64 where the device has it."""
    knots, table = piecewise_table(psi, torch.float32 if device.type == "mps" else torch.float64, scale)
    return knots.detach().to(compute), table.to(compute)


def knot_locator(psi) -> KnotLocator:
    """The float32 CPU locator of the bank ``psi``'s knots, as the native pass builds it."""
    return _build_prepared(psi, torch.float32, 1.0, torch.device("cpu"))[1]


def _distinct_knots(knots: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct finite knots, and the table's rows for the intervals between them.

    Tied knots bound empty intervals that no u falls into, so the table only needs the row after
    each distinct knot; without the ties no grid cell has to hold several copies of one knot
    (``channel_init`` "exp" puts every channel's knots at the same points: L-fold ties, and for
    L > ``MAX_KNOTS_PER_CELL`` the grid would give up for searchsorted). A data-dependent size:
    eager code only.
    """
    distinct, rows = _distinct_rows(knots)
    return distinct, table.index_select(0, rows)


def _distinct_rows(knots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct finite knots, and the table rows (int64) of the intervals between them."""
    distinct, counts = torch.unique_consecutive(knots[knots != float("inf")], return_counts=True)
    return distinct, torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])  # knots below each interval


# The native passes as registered operators (schema, fake output, autograd): what compiled and exported graphs
# call. They take the knots and the whole tables, and find the grid themselves (``operator_grid``): its size
# depends on the knots' values, which a graph's shapes cannot. Eager code calls the passes directly.
_OPERATOR_GRIDS: dict = {}  # the knots' bytes -> (rows, grid), the latest used last
_OPERATOR_GRIDS_KEPT = 64  # every layer's bank of a large model


def operator_grid(knots: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """For sorted float32 knots [K]: the table rows (int64) of the intervals between the distinct knots and
    their native grid (a ``KnotLocator.grid``), the one eager code builds; kept for the same knots (a compiled
    forward's queries and keys and its backward, every call of a layer). Where the knots crowd every grid, one
    cell holds them all: a longer search, the same intervals."""
    knots = knots.detach().to(torch.float32).contiguous()
    key = ctypes.string_at(knots.data_ptr(), knots.nbytes)  # a hash of ~2 KB: no compare per kept grid
    found = _OPERATOR_GRIDS.pop(key, None)
    if found is None:
        distinct, rows = _distinct_rows(knots)
        grid = KnotLocator(distinct, True, native_cells).grid
        if grid is None:
            grid = ("linear", 0.0, 0.0, 1, torch.zeros(1, dtype=torch.int32), distinct[:, None].contiguous())
        found = rows, grid
        while len(_OPERATOR_GRIDS) >= _OPERATOR_GRIDS_KEPT:
            _OPERATOR_GRIDS.pop(next(iter(_OPERATOR_GRIDS)), None)
    _OPERATOR_GRIDS[key] = found
    return found


def luna_channel_features_reference(u: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor,
                                    knots: torch.Tensor, eps: float) -> torch.Tensor:
    """``luna_convert::luna_channel_features`` in PyTorch ops: relu(slope[i] u + intercept[i]) with i the number of
    knots below u (searchsorted; no grid), each channel divided by its sum over the M projections + eps where
    eps >= 0. The operator's reference (tests/test_method_operators.py)."""
    cell = torch.searchsorted(knots.to(u.dtype), u.detach().contiguous(), right=True)
    features = torch.relu(slope[cell] * u[..., None] + intercept[cell])
    return features if eps < 0 else features / (features.sum(-2, keepdim=True) + eps)


def luna_projected_channel_features_reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor,
                                              slope: torch.Tensor, intercept: torch.Tensor, knots: torch.Tensor,
                                              eps: float) -> torch.Tensor:
    """``luna_convert::luna_projected_channel_features`` in PyTorch ops: the channels of u = x W^T + b."""
    return luna_channel_features_reference(x @ weight_t + bias, slope, intercept, knots, eps)


@torch.library.custom_op("luna_convert::luna_channel_features", mutates_args=(), device_types="cpu")
def channel_features_op(u: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, knots: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """The features [..., M, L] of u [..., M] float32 from the tables [K + 1, L] of the knots [K] (float32);
    eps < 0: no feature norm."""
    rows, grid = operator_grid(knots)
    return luna_native.forward_pass(u.contiguous(), slope.index_select(0, rows), intercept.index_select(0, rows),
                                    grid, eps)


@channel_features_op.register_fake
def _channel_features_shape(u, slope, intercept, knots, eps):
    return u.new_empty((*u.shape, slope.shape[1]))


@torch.library.custom_op("luna_convert::luna_channel_features_backward", mutates_args=(), device_types="cpu")
def channel_features_backward_op(grad: torch.Tensor, u: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor,
                                 knots: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of u, slope and intercept of ``luna_channel_features``, natively."""
    rows, grid = operator_grid(knots)
    grad_u, grad_slope, grad_intercept = luna_native.backward_pass(
        u.contiguous(), slope.index_select(0, rows), intercept.index_select(0, rows), grid, eps, grad)
    return (grad_u, torch.zeros_like(slope).index_add_(0, rows, grad_slope),
            torch.zeros_like(intercept).index_add_(0, rows, grad_intercept))


@channel_features_backward_op.register_fake
def _channel_features_backward_shape(grad, u, slope, intercept, knots, eps):
    return u.new_empty(u.shape), slope.new_empty(slope.shape), intercept.new_empty(intercept.shape)


def _channel_features_context(ctx, inputs, output):
    u, slope, intercept, knots, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(u, slope, intercept, knots)


def _channel_features_backward(ctx, grad):
    u, slope, intercept, knots = ctx.saved_tensors
    return (*channel_features_backward_op(grad, u, slope, intercept, knots, ctx.eps), None, None)


channel_features_op.register_autograd(_channel_features_backward, setup_context=_channel_features_context)


@torch.library.custom_op("luna_convert::luna_projected_channel_features", mutates_args=(), device_types="cpu")
def projected_channel_features_op(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, slope: torch.Tensor,
                                  intercept: torch.Tensor, knots: torch.Tensor, eps: float) -> torch.Tensor:
    """The features [B, H, N, M, L] of u = x W^T + b for x [B, H, N, d], the projection inside the pass."""
    rows, grid = operator_grid(knots)
    return luna_native.native_projected_channel_features(x, weight_t.contiguous(), bias.contiguous(),
                                                         slope.index_select(0, rows), intercept.index_select(0, rows),
                                                         grid, None if eps < 0 else eps)


@projected_channel_features_op.register_fake
def _projected_channel_features_shape(x, weight_t, bias, slope, intercept, knots, eps):
    return x.new_empty((*x.shape[:-1], weight_t.shape[1], slope.shape[1]))


def _projected_context(ctx, inputs, output):
    x, weight_t, bias, slope, intercept, knots, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight_t, bias, slope, intercept, knots)


def _projected_backward(ctx, grad):
    """Through u = x W^T + b, recomputed: the pass keeps no u (it is for inference; this makes it complete)."""
    x, weight_t, bias, slope, intercept, knots = ctx.saved_tensors
    u = torch.matmul(x, weight_t) + bias
    grad_u, grad_slope, grad_intercept = channel_features_backward_op(grad, u, slope, intercept, knots, ctx.eps)
    grad_x = torch.matmul(grad_u, weight_t.t()) if ctx.needs_input_grad[0] else None
    grad_weight_t = torch.einsum("...nd,...nm->dm", x, grad_u) if ctx.needs_input_grad[1] else None
    grad_bias = grad_u.reshape(-1, grad_u.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
    return grad_x, grad_weight_t, grad_bias, grad_slope, grad_intercept, None, None


projected_channel_features_op.register_autograd(_projected_backward, setup_context=_projected_context)


def graph_tables(psi, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compiled code's float32 tables (differentiable) and knots, built in the graph on every call:
    (slope, intercept, knots), what the operators above take."""
    knots, table = channel_table(psi, torch.float32, scale, torch.device("cpu"))
    channels = table.shape[1] // 2
    return table[:, :channels], table[:, channels:], knots


def _prepared(psi, compute: torch.dtype, scale: float, device: torch.device):
    """The native pass's ((slope, intercept), locator) in ``compute`` dtype (eager code; compiled code takes
    ``graph_tables``), from the cache when that is safe."""
    params = (psi.w1, psi.b1, psi.w2, psi.b2)
    recording = records_grad(*params)
    if recording:
        scope = current_recompute_scope()
        if scope is None:
            return _build_prepared(psi, compute, scale, device)
        # inside a streamed backward: one set of tables (and one locator) for all its chunks
        return scope.shared((TABLES_KEY, id(psi), compute, scale, device),
                            lambda: _build_prepared(psi, compute, scale, device))
    # Comparing the ~1.5k parameter values costs 6 us; building the tables 0.33 ms (defaults, CPU, measured).
    key = (compute, scale, device)
    hit = _TABLE_CACHE.get(psi)
    if hit is not None and hit.fits(key, params):
        return hit.prepared
    prepared = _build_prepared(psi, compute, scale, device)
    _TABLE_CACHE[psi] = _CachedTables(key, params, prepared)
    return prepared


def scalar_channels(u: torch.Tensor, psi, scale: float = 1.0) -> torch.Tensor:
    """``scale * psi(u)`` for u [..., M] -> [..., M, L]: the same values and gradients as the
    reference ``ScalarChannels.forward`` (times ``scale``) without expanding the hidden layer.

    Computes in float32 (float64 for float64 input) with autocast off and
    returns u's dtype. ``scale`` (> 0) is folded into the tables for free.
    """
    return scalar_channels_of(psi, u, scale=scale)[0]


def scalar_channels_of(psi, *us: torch.Tensor, scale: float = 1.0,
                       norm_eps: float | None = None) -> tuple[torch.Tensor, ...]:
    """``scalar_channels`` of each of ``us`` (one device) in standard operators (``ops.piecewise``), one table
    for all: the interval of each element from ``knot_intervals`` (a grid of the knots), in exported graphs
    from the grid frozen before the export (``frozen_for_export``), else by the binary search. With
    ``norm_eps``, each channel divided by its sum over the M projections + norm_eps (``sum_normalize``)."""
    compute = accumulation_dtype(*us)
    device = us[0].device
    with torch.autocast(device_type=device.type, enabled=False):
        frozen = _FROZEN.get(psi) if torch.compiler.is_exporting() else None
        if frozen is not None and frozen[0] == (compute, float(scale)):
            table, locate = frozen[1]
        else:
            knots, table = channel_table(psi, compute, float(scale), device)
            if _cpu_inference(psi, us):
                return tuple(piecewise_relu_features(u.to(compute), knots, table, norm_eps).to(u.dtype) for u in us)
            if torch.compiler.is_exporting():
                locate = lambda x: binary_search(x.reshape(-1), knots)  # noqa: E731 - standard operators only
            else:
                locate = lambda x: knot_intervals(x, knots)  # noqa: E731
        out = []
        for u in us:
            x = u.to(compute)
            channels = piecewise_relu_channels(x, table, locate(x.detach()))
            if norm_eps is not None:  # from the float32 values: in half precision a sum can overflow
                # channel by channel, a sum over u's last axis: over [..., M, L]'s M it was 4x slower in ONNX
                # Runtime (a broadcast with an inner span of L)
                channels = [sum_normalize(c, -1, norm_eps) for c in channels]
            out.append(torch.stack(channels, -1).to(u.dtype))
        return tuple(out)


def _cpu_inference(psi, us: tuple[torch.Tensor, ...]) -> bool:
    """Whether this call is CPU code, eager or compiled (not exported), that records no gradient: then
    ``ops.piecewise.piecewise_relu_features`` (tokens in chunks) serves it."""
    if torch.compiler.is_exporting() or us[0].device.type != "cpu":
        return False
    return not records_grad(*us, *psi.parameters())


# psi -> its prepared lookup, frozen for an export (``frozen_for_export``): the grid's size depends on the
# knots' values, which a traced graph does not have.
_FROZEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def frozen_for_export(psi, scale: float, compute: torch.dtype = torch.float32):
    """Inside it, an exported graph evaluates ``psi`` (times ``scale``) with the grid of its current knots as
    constants: an export holds the parameters fixed, and a grid costs 1 + depth gathers per element where
    the binary search costs log2(K + 1) (gathers are ONNX Runtime's slowest step here)."""
    with torch.no_grad():
        knots, table = channel_table(psi, compute, float(scale), psi.w1.device)
    grid = KnotGrid.build(knots)
    lookup = (table, lambda x: binary_search(x.reshape(-1), knots)) if grid is None else \
        (grid.rows_of(table), lambda x: grid.index(x.reshape(-1)))
    _FROZEN[psi] = ((compute, float(scale)), lookup)
    try:
        yield
    finally:
        _FROZEN.pop(psi, None)


def native_kernel_applies(projections: int, channels: int, compute: torch.dtype, device: torch.device) -> bool:
    """Whether ``channel_features_of`` runs the native kernel for these sizes, dtype and device now."""
    return (device.type == "cpu" and compute == torch.float32 and luna_native.fits(projections, channels)
            and luna_native.native_available())


def channel_features_of(psi, *us: torch.Tensor, scale: float = 1.0,
                        norm_eps: float | None = None) -> tuple[torch.Tensor, ...]:
    """``scalar_channels_of`` [..., M, L] of each of ``us``, and with ``norm_eps`` each channel divided by
    (its sum over the M projections + norm_eps) (``ops.normalize.sum_normalize``): in one native pass
    (``luna_native``) where it applies, else in PyTorch; in u's dtype."""
    compute, device = accumulation_dtype(*us), us[0].device
    if native_kernel_applies(us[0].shape[-1], psi.channels, compute, device):
        with torch.autocast(device_type=device.type, enabled=False):
            if torch.compiler.is_compiling():  # the operators, the grid built in the graph
                tables, eps = graph_tables(psi, float(scale)), -1.0 if norm_eps is None else float(norm_eps)
                return tuple(channel_features_op(u.to(torch.float32), *tables, eps).to(u.dtype)
                             for u in us)
            (slope, intercept), locate = _prepared(psi, compute, float(scale), device)
            if locate.grid is not None:  # else crowded knots: searchsorted, on the PyTorch path
                return tuple(native_channel_features(u, slope, intercept, locate.grid, norm_eps).to(u.dtype)
                             for u in us)
    return scalar_channels_of(psi, *us, scale=scale, norm_eps=norm_eps)


def projected_channel_features_of(psi, weight: torch.Tensor, bias: torch.Tensor, *xs: torch.Tensor, scale: float = 1.0,
                                  norm_eps: float | None = None) -> tuple[torch.Tensor, ...] | None:
    """``channel_features_of(psi, *(x W^T + b for x in xs))`` for float32 xs [B, H, N, d], W [M, d], b [M], with
    the projection inside the native pass (``luna_native.native_projected_channel_features``): no u in
    memory, x read where it lies. For inference: None (the caller then projects and takes
    ``channel_features_of``) when a gradient is recorded, under autocast, or where the native kernel does
    not apply."""
    device = xs[0].device
    if records_grad(weight, bias, *xs, *psi.parameters()) or \
            any(t.dtype != torch.float32 for t in (weight, bias, *xs)) or torch.is_autocast_enabled(device.type) or \
            not native_kernel_applies(weight.shape[0], psi.channels, torch.float32, device):
        return None
    if torch.compiler.is_compiling():  # the operator, the grid built in the graph
        tables, eps = graph_tables(psi, float(scale)), -1.0 if norm_eps is None else float(norm_eps)
        return tuple(projected_channel_features_op(x, weight.t(), bias, *tables, eps) for x in xs)
    (slope, intercept), locate = _prepared(psi, torch.float32, float(scale), device)
    if locate.grid is None:
        return None
    weight_t, bias = weight.t().contiguous(), bias.contiguous()
    return tuple(native_projected_channel_features(x, weight_t, bias, slope, intercept, locate.grid, norm_eps)
                 for x in xs)
