"""The fast path of LUNA's scalar channel bank (``scalar_channels``; the reference is
``luna.ScalarChannels.forward``).

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

Per token there is then one interval search per scalar (not per channel: the
knots of all channels are merged) and one row gather from the [K + 1, 2L]
table for all L outputs; nothing of size ``hidden`` is ever expanded per
token. On the CPU the search is a grid of cells over x / (1 + |x|) with at most
a few comparisons per cell (``torch.searchsorted`` costs ~50 ns a scalar there);
elsewhere it is ``torch.searchsorted``. The per-token part is a custom autograd
function whose backward needs only per-interval sums of ``g`` and ``g * u`` (a
histogram over the interval index, ``index_add_``) plus ``g * slope`` for u. It
saves u, the int16 interval index and its own output (which the linear
attention downstream keeps alive anyway), never N x M x L x hidden values, and
works in cache-sized chunks of tokens.

Numerics: tables are built in float64, evaluation runs in float32 (float64
for float64 inputs) with autocast disabled, and the result has the input's
dtype. At a knot exactly (u == t, a set of measure zero) the value is the same
as the reference's; the subgradient for the parameters of a decreasing unit
(w1 < 0) counts the unit as active there, where ``torch.relu`` would count it
as inactive.
"""

from __future__ import annotations

import math
import weakref

import torch

from ..ops.dtypes import accumulation_dtype
from ..ops.streamed import current_recompute_scope

# Scalars (tokens x heads x projections) per chunk on the CPU: a chunk's
# [chunk, 2L] gathered pieces and [chunk, L] output stay in the L2 cache.
CPU_CHUNK = 1 << 14
GPU_CHUNK = 1 << 22
# Grid locator: at most this many knots may share a cell (else a finer grid, then searchsorted).
MAX_KNOTS_PER_CELL = 4
MAX_CELLS = 1 << 17
# Key of the channel tables in a streamed backward's recompute scope.
TABLES_KEY = "luna-channel-tables"


def channel_tables(psi, dtype: torch.dtype = torch.float64, scale: float = 1.0):
    """Knots and per-interval affine pieces of the channel bank ``psi``.

    Returns ``(knots [K], slope [K + 1, L], intercept [K + 1, L])`` in ``dtype``
    with K = rows * hidden; ``knots`` is sorted ascending (constant units sit
    at +inf at the end) and interval k is ``knots[k-1] < u <= knots[k]``, the
    index ``torch.searchsorted(knots, u)`` returns. slope and intercept are
    differentiable functions of ``psi``'s parameters and include the factor
    ``scale`` (which must be > 0 so that relu commutes with it).

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
    # Contribution of unit (r, h) to channel l: [rows * hidden, L]; block diagonal unless shared.
    wa, wc = w2 * w1, w2 * b1  # [L, hidden]
    if rows == 1:
        unit_a, unit_c = wa.T, wc.T
    else:
        eye = torch.eye(channels, dtype=dtype, device=w1.device)
        unit_a = (wa[:, :, None] * eye[:, None, :]).reshape(rows * hidden, channels)
        unit_c = (wc[:, :, None] * eye[:, None, :]).reshape(rows * hidden, channels)
    tables = []
    for unit, offset in ((unit_a, None), (unit_c, b2)):
        base = first @ unit if offset is None else first @ unit + offset  # [L]
        steps = unit.index_select(0, order) * step[:, None]
        tables.append(torch.cat([base[None], base + torch.cumsum(steps, 0)], 0) * scale)
    slope, intercept = tables
    return knots, slope.contiguous(), intercept.contiguous()


def _grid_cell(x: torch.Tensor, cells: int) -> torch.Tensor:
    """A monotone non-decreasing map of floats to cells 0..cells-1 (NaN -> 0).

    x / (1 + |x|) squeezes the real line into (-1, 1), so heavy-tailed knot
    sets (t = -b1/w1 is a ratio of two random numbers) still spread over the
    cells. Knots and inputs go through the very same float ops, so a knot in
    a lower cell than u is always below u, whatever the rounding.
    """
    v = x.abs().clamp_(max=1e30).add_(1)
    v = torch.div(x, v, out=v)
    v.add_(1).mul_(cells / 2).clamp_(0, cells - 1).nan_to_num_(0.0)
    return v.to(torch.int64)


class KnotLocator:
    """``searchsorted(knots, u)`` (number of knots < u) for a fixed sorted knot vector.

    On the CPU ``torch.searchsorted`` costs ~50 ns a scalar; a grid of cells
    does it in a few vectorised passes: index = (knots in lower cells) +
    (knots in u's cell below u), with at most ``MAX_KNOTS_PER_CELL``
    comparisons. Falls back to searchsorted when knots crowd one cell
    (e.g. many identical knots).
    """

    def __init__(self, knots: torch.Tensor, use_grid: bool):
        self.knots, self.start, self.kpad = knots, None, []
        if not use_grid:
            return
        # Knots at +inf (constant units) are never below any u: leave them out.
        kf = knots[knots != float("inf")]
        if kf.numel() == 0:
            self.cells, self.start = 1, torch.zeros(1, dtype=torch.int64, device=knots.device)
            return
        cells = max(1024, 1 << math.ceil(math.log2(8 * kf.numel())))
        while True:
            cell = _grid_cell(kf, cells)
            counts = torch.bincount(cell, minlength=cells)
            most = int(counts.max())
            if most <= MAX_KNOTS_PER_CELL:
                break
            if cells * 8 > MAX_CELLS:
                return  # crowded: searchsorted
            cells *= 8
        first = torch.cumsum(counts, 0) - counts
        order = torch.argsort(cell, stable=True)
        sorted_cell = cell[order]
        slot = torch.arange(sorted_cell.numel(), device=knots.device) - first[sorted_cell]
        kpad = torch.full((most, cells), float("inf"), dtype=knots.dtype, device=knots.device)
        kpad[slot, sorted_cell] = kf[order]
        self.cells, self.start, self.kpad = cells, first, list(kpad.unbind(0))

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        """int64 interval index of every element of the 1-D tensor u."""
        if self.start is None:
            return torch.searchsorted(self.knots, u)
        cell = _grid_cell(u, self.cells)
        index = self.start.index_select(0, cell)
        for kp in self.kpad:
            index += u > kp.index_select(0, cell)
        return index


class _PiecewiseLinearReLU(torch.autograd.Function):
    """out[..., l] = relu(slope[i, l] * u + intercept[i, l]) with i = searchsorted(knots, u), per element of u.

    Saves u, the interval index (int16/int32) and the output; the backward
    turns the output gradient into per-interval sums of g and g * u
    (``index_add_``), which autograd then carries back to the parameters
    through the table construction.
    """

    @staticmethod
    def forward(ctx, u, slope, intercept, locate, out_dtype, chunk, track):
        n, channels = u.numel(), slope.shape[1]
        flat_u = u.reshape(-1)
        table = torch.cat([slope, intercept], 1)  # [K+1, 2L]
        out = torch.empty((*u.shape, channels), dtype=out_dtype, device=u.device)
        flat_out = out.view(n, channels)
        index_dtype = torch.int16 if table.shape[0] <= torch.iinfo(torch.int16).max else torch.int32
        saved_index = torch.empty(n if track else 0, dtype=index_dtype, device=u.device)
        same = out_dtype == u.dtype
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            uc = flat_u[s:e]
            index = locate(uc)
            if track:
                saved_index[s:e] = index
            piece = table.index_select(0, index).view(-1, 2, channels)
            if same:
                oc = flat_out[s:e]
                torch.addcmul(piece[:, 1], uc[:, None], piece[:, 0], out=oc)
                oc.relu_()
            else:
                flat_out[s:e] = torch.addcmul(piece[:, 1], uc[:, None], piece[:, 0]).relu_()
        ctx.chunk = chunk
        if track:
            ctx.save_for_backward(u, saved_index, slope, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        u, saved_index, slope, out = ctx.saved_tensors
        need_u, need_slope, need_intercept = ctx.needs_input_grad[:3]
        need_table = need_slope or need_intercept
        n, channels = u.numel(), slope.shape[1]
        flat_u, flat_out = u.reshape(-1), out.view(n, channels)
        flat_grad = grad_out.reshape(n, channels)  # a copy only if the caller's gradient is oddly strided
        grad_u = torch.empty_like(u) if need_u else None
        flat_grad_u = grad_u.view(-1) if need_u else None
        grad_table = torch.zeros((slope.shape[0], 2 * channels), dtype=u.dtype, device=u.device) if need_table else None
        both = torch.empty((min(ctx.chunk, n), 2, channels), dtype=u.dtype, device=u.device) if need_table else None
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            uc, index = flat_u[s:e], saved_index[s:e].long()
            g = torch.ops.aten.threshold_backward(flat_grad[s:e].to(u.dtype), flat_out[s:e].to(u.dtype), 0)  # [c, L]
            if need_u:
                flat_grad_u[s:e] = (g * slope.index_select(0, index)).sum(-1)
            if need_table:
                x = both[: e - s]
                torch.mul(g, uc[:, None], out=x[:, 0])
                x[:, 1] = g
                grad_table.index_add_(0, index, x.view(-1, 2 * channels))
        grad_slope = grad_table[:, :channels] if need_slope else None
        grad_intercept = grad_table[:, channels:] if need_intercept else None
        return grad_u, grad_slope, grad_intercept, None, None, None, None


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
        return all(a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)
                   for a, b in zip(self.values, params))


# psi -> _CachedTables: reused while the parameter values are unchanged and no gradient is being recorded
# (e.g. phi(k) right after phi(q), and every layer call at inference).
_TABLE_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _build_prepared(psi, compute: torch.dtype, scale: float, device: torch.device):
    """((slope, intercept), locator) in ``compute`` dtype, built now (differentiable when recording)."""
    table_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    knots, slope, intercept = channel_tables(psi, table_dtype, scale)
    return ((slope.to(compute).contiguous(), intercept.to(compute).contiguous()),
            KnotLocator(knots.to(compute), use_grid=device.type == "cpu"))


def _prepared(psi, compute: torch.dtype, scale: float, device: torch.device):
    """(slope, intercept, locator) in ``compute`` dtype, from the cache when that is safe."""
    params = (psi.w1, psi.b1, psi.w2, psi.b2)
    recording = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    if recording:
        scope = current_recompute_scope()
        if scope is None:
            (slope, intercept), locate = _build_prepared(psi, compute, scale, device)
        else:  # inside a streamed backward: one set of tables (and one locator) for all its chunks
            (slope, intercept), locate = scope.shared((TABLES_KEY, id(psi), compute, scale, device),
                                                      lambda: _build_prepared(psi, compute, scale, device))
        return slope, intercept, locate
    # Comparing the ~1.5k parameter values costs 6 us; building the tables 0.33 ms (defaults, CPU, measured).
    key = (compute, scale, device)
    hit = _TABLE_CACHE.get(psi)
    if hit is not None and hit.fits(key, params):
        return hit.prepared
    (slope, intercept), locate = _build_prepared(psi, compute, scale, device)
    prepared = (slope, intercept, locate)
    _TABLE_CACHE[psi] = _CachedTables(key, params, prepared)
    return prepared


def scalar_channels(u: torch.Tensor, psi, scale: float = 1.0) -> torch.Tensor:
    """``scale * psi(u)`` for u [..., M] -> [..., M, L]: the same values and gradients as the
    reference ``ScalarChannels.forward`` (times ``scale``) without expanding the hidden layer.

    Computes in float32 (float64 for float64 input) with autocast off and
    returns u's dtype. ``scale`` (> 0) is folded into the tables for free.
    """
    compute = accumulation_dtype(u)
    chunk = CPU_CHUNK if u.device.type == "cpu" else GPU_CHUNK
    with torch.autocast(device_type=u.device.type, enabled=False):
        slope, intercept, locate = _prepared(psi, compute, float(scale), u.device)
        track = torch.is_grad_enabled() and (u.requires_grad or slope.requires_grad or intercept.requires_grad)
        return _PiecewiseLinearReLU.apply(u.to(compute).contiguous(), slope, intercept, locate, u.dtype, chunk, track)
