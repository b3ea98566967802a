"""Fast kernels for linear attention: the LUNA scalar channel bank, the linear-attention
core and the depthwise convolution over tokens.

LUNA channel bank (``scalar_channels``, the fast path of ``feature_maps.ScalarChannels``).
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

``linear_attention_core``: phi_q S / (phi_q z + eps) with a hand-written
backward (fewer passes over [N, d] tensors, contiguous gradients).

``depthwise_conv_tokens``: depthwise Conv1d/Conv2d over tokens in the
[..., tokens, C] layout as shifted multiply-adds, with a matching backward.
"""

from __future__ import annotations

import contextvars
import itertools
import math
import weakref

import torch

# Scalars (tokens x heads x projections) per chunk on the CPU: a chunk's
# [chunk, 2L] gathered pieces and [chunk, L] output stay in the L2 cache.
CPU_CHUNK = 1 << 14
GPU_CHUNK = 1 << 22
# Grid locator: at most this many knots may share a cell (else a finer grid, then searchsorted).
MAX_KNOTS_PER_CELL = 4
MAX_CELLS = 1 << 17
# Depthwise conv backward: bytes of each per-tap product for the weight gradient.
DWC_CHUNK_BYTES = 1 << 20


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (bf16/fp16 inputs accumulate in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


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


class _Locator:
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


class _TableScope:
    """Tables built once per channel bank while many chunks are recomputed with gradients.

    Inside the scope (``streamed_linear_attention``'s backward) ``_prepared``
    hands out detached leaf copies of the tables, so every chunk reuses one
    set (and one locator) instead of rebuilding them; ``pullback`` then
    carries the leaves' summed gradients back to the bank's parameters once.
    """

    def __init__(self):
        self.entries: dict = {}  # key -> (tables with graph, leaf tables, prepared)

    def leaves(self) -> list[torch.Tensor]:
        return [leaf for _, leaves, _ in self.entries.values() for leaf in leaves]

    def get(self, psi, compute, scale, device):
        key = (id(psi), compute, scale, device)
        if key not in self.entries:
            slope, intercept, locate = _build_prepared(psi, compute, scale, device)
            leaves = (slope.detach().requires_grad_(), intercept.detach().requires_grad_())
            self.entries[key] = ((slope, intercept), leaves, (*leaves, locate))
        return self.entries[key][2]

    def pullback(self, leaf_grads: dict, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Gradients of ``params`` from the accumulated gradients of the leaf tables."""
        outputs, grads = [], []
        for tables, leaves, _ in self.entries.values():
            for t, leaf in zip(tables, leaves):
                if leaf in leaf_grads and t.requires_grad:
                    outputs.append(t)
                    grads.append(leaf_grads[leaf])
        if not outputs or not params:
            return [None] * len(params)
        return list(torch.autograd.grad(outputs, params, grads, allow_unused=True))


# The scope of the streamed backward running in this thread (a thread's context starts with None).
_TABLE_SCOPE: contextvars.ContextVar[_TableScope | None] = contextvars.ContextVar("luna_table_scope", default=None)


def _build_prepared(psi, compute: torch.dtype, scale: float, device: torch.device):
    """(slope, intercept, locator) in ``compute`` dtype, built now (differentiable when recording)."""
    table_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    knots, slope, intercept = channel_tables(psi, table_dtype, scale)
    return (slope.to(compute).contiguous(), intercept.to(compute).contiguous(),
            _Locator(knots.to(compute), use_grid=device.type == "cpu"))


def _prepared(psi, compute: torch.dtype, scale: float, device: torch.device):
    """(slope, intercept, locator) in ``compute`` dtype, from the cache when that is safe."""
    params = (psi.w1, psi.b1, psi.w2, psi.b2)
    recording = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    if recording:
        scope = _TABLE_SCOPE.get()
        if scope is not None:
            return scope.get(psi, compute, scale, device)
        return _build_prepared(psi, compute, scale, device)
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
    compute = accumulation_dtype(u)
    chunk = CPU_CHUNK if u.device.type == "cpu" else GPU_CHUNK
    with torch.autocast(device_type=u.device.type, enabled=False):
        slope, intercept, locate = _prepared(psi, compute, float(scale), u.device)
        track = torch.is_grad_enabled() and (u.requires_grad or slope.requires_grad or intercept.requires_grad)
        return _PiecewiseLinearReLU.apply(u.to(compute).contiguous(), slope, intercept, locate, u.dtype, chunk, track)


# --------------------------------------------------------------------------- linear attention core
class _LinearAttentionCore(torch.autograd.Function):
    """out = (phi_q S) / (phi_q z + eps) with S = phi_k^T v, z = sum_j phi_k[j] (per batch and head).

    A hand-written backward: autograd's version of the division and the slicing
    makes several extra full passes over [N, d] tensors, which at long N run
    at memory speed and cost more than the matrix products. It does not keep
    the output: grad_out . out, the one place it enters, equals
    (grad_out r S^T) . phi_q, and that product is a piece of phi_q's gradient
    anyway. Every gradient comes back contiguous.
    """

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, eps):
        kv_t = torch.matmul(v.transpose(-1, -2), phi_k)  # S^T [B, H, d, D]
        z = phi_k.sum(dim=-2, keepdim=True)  # [B, H, 1, D]
        r = torch.matmul(phi_q, z.transpose(-1, -2)).add_(eps).reciprocal_()  # 1 / (phi_q z + eps) [B, H, N, 1]
        out = torch.matmul(phi_q, kv_t.transpose(-1, -2)).mul_(r)  # [B, H, N, d]
        ctx.save_for_backward(phi_q, phi_k, v, kv_t, z, r)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        phi_q, phi_k, v, kv_t, z, r = ctx.saved_tensors
        grad_num = grad_out * r  # d loss / d (phi_q S)   [B, H, N, d]
        grad_q = torch.matmul(grad_num, kv_t)  # its part of phi_q's gradient   [B, H, N, D]
        # d loss / d (phi_q z) = -(grad_out . out) r, and grad_out . out = (grad_num S^T) . phi_q
        grad_den = torch.linalg.vecdot(grad_q, phi_q).unsqueeze_(-1).mul_(r).neg_()  # [B, H, N, 1]
        grad_q.addcmul_(grad_den, z)
        grad_kv_t = torch.matmul(grad_num.transpose(-1, -2), phi_q)  # [B, H, d, D]
        grad_z = torch.matmul(grad_den.transpose(-1, -2), phi_q)  # [B, H, 1, D]
        grad_k = torch.matmul(v, grad_kv_t).add_(grad_z) if ctx.needs_input_grad[1] else None
        grad_v = torch.matmul(phi_k, grad_kv_t.transpose(-1, -2)) if ctx.needs_input_grad[2] else None
        return grad_q if ctx.needs_input_grad[0] else None, grad_k, grad_v, None


def linear_attention_core(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """phi_q S / (phi_q z + eps) for [B, H, N, D] features and [B, H, N, d] values, all of one float dtype.

    The caller handles masking (zeroed phi_k rows) and dtypes; see
    ``luna_convert.linear_attention.linear_attention``.
    """
    return _LinearAttentionCore.apply(phi_q, phi_k, v, eps)


# --------------------------------------------------------------------------- depthwise convolution over tokens
def _shift_slices(n: int, s: int) -> tuple[slice, slice] | None:
    """(dst, src) with dst[t] <- src[t + s] for the t where 0 <= t + s < n; None if empty."""
    if abs(s) >= n:
        return None
    return slice(max(0, -s), min(n, n - s)), slice(max(0, s), min(n, n + s))


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
    times slower). The DWC branch in ``attention.DepthwiseConvBranch`` can call it.
    """
    ndim = weight.dim() - 2
    if any(k % 2 == 0 for k in weight.shape[2:]):
        raise ValueError(f"odd kernel sizes only, got {tuple(weight.shape[2:])}")
    if x.dim() < ndim + 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} does not match a depthwise weight {tuple(weight.shape)}")
    return _DepthwiseConv.apply(x, weight, bias, ndim)


# --------------------------------------------------------------------------- streamed linear attention
def _token_chunks(n: int, chunk: int):
    return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _chunk_features(phi, x: torch.Tensor, rows: slice, compute: torch.dtype,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """phi(x[:, :, rows]) in ``compute`` dtype, rows of pad keys zeroed where ``keep`` ([B, 1, N, 1] bool) says so."""
    feats = phi(x[:, :, rows]).to(compute)
    return feats if keep is None else feats * keep[:, :, rows].to(feats.dtype)


class _StreamedLinearAttention(torch.autograd.Function):
    """Linear attention that never holds phi(q) or phi(k) for all tokens at once.

    Forward: S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j) are accumulated over
    chunks of keys, then each chunk of queries gives its rows of the output.
    Backward recomputes the features chunk by chunk (one extra feature-map
    forward) and pulls their gradients through ``torch.autograd.grad``, so
    only q, k, v, S and z are saved. Long sequences gain twice: every
    intermediate stays small enough for the cache, and no [N, D]-sized buffer
    is allocated per call (above 32 MiB, glibc hands those out as fresh
    mmapped pages, and faulting them in costs as much as the arithmetic).
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, eps, chunk, phi_q, phi_k, *params):
        n, compute = v.shape[2], accumulation_dtype(q, k, v)
        keep = None if key_mask is None else key_mask[:, None, :, None]
        kv = z = None
        for c in _token_chunks(n, chunk):
            pk = _chunk_features(phi_k, k, c, compute, keep)
            part = torch.matmul(pk.transpose(-1, -2), v[:, :, c].to(compute))  # [B, H, D, d]
            kv = part if kv is None else kv.add_(part)
            z = pk.sum(-2) if z is None else z.add_(pk.sum(-2))  # [B, H, D]
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        for c in _token_chunks(n, chunk):
            pq = _chunk_features(phi_q, q, c, compute)
            r = torch.matmul(pq, z[..., None]).add_(eps).reciprocal_()
            out[:, :, c] = torch.matmul(pq, kv).mul_(r)
        device_type = v.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.eps, ctx.chunk, ctx.phi_q, ctx.phi_k, ctx.compute = eps, chunk, phi_q, phi_k, compute
        ctx.save_for_backward(q, k, v, key_mask, kv, z, *params)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        scope = _TableScope()
        token = _TABLE_SCOPE.set(scope)
        try:
            return _StreamedLinearAttention._backward(ctx, grad_out, scope)
        finally:
            _TABLE_SCOPE.reset(token)

    @staticmethod
    def _backward(ctx, grad_out, scope: _TableScope):
        q, k, v, key_mask, kv, z, *params = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        need_params = ctx.needs_input_grad[8:]
        wanted = [p for p, need in zip(params, need_params) if need]
        param_grads = [torch.zeros_like(p) for p in wanted]
        leaf_grads: dict = {}
        n = v.shape[2]
        grad_q = torch.empty_like(q) if need_q else None
        grad_k = torch.empty_like(k) if need_k else None
        grad_v = torch.empty_like(v) if need_v else None
        d_kv, d_z = torch.zeros_like(kv), torch.zeros_like(z)
        keep = None if key_mask is None else key_mask[:, None, :, None]
        device_type, autocast_on, autocast_dtype = ctx.autocast

        def features(phi, x, need_x, rows, masked=False):
            """phi(x[rows]) recomputed with a graph back to x's rows (if needed) and the parameters."""
            xc = x[:, :, rows].detach().requires_grad_(need_x)
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                feats = _chunk_features(phi, xc, slice(None), ctx.compute,
                                        keep[:, :, rows] if masked and keep is not None else None)
            return xc, feats

        def pull(feats, xc, need_x, grad_feats, grad_x, rows):
            """Back-propagate grad_feats into x's rows, the parameters and the scope's leaf tables."""
            if not feats.requires_grad:  # nothing upstream needs a gradient
                if need_x:
                    grad_x[:, :, rows] = 0
                return
            leaves = scope.leaves() if wanted else []
            inputs = ([xc] if need_x else []) + wanted + leaves
            grads = list(torch.autograd.grad(feats, inputs, grad_feats, allow_unused=True))
            if need_x:
                grad_x[:, :, rows] = grads.pop(0)
            for acc, g in zip(param_grads, grads[: len(wanted)]):
                if g is not None:
                    acc.add_(g)
            for leaf, g in zip(leaves, grads[len(wanted):]):
                if g is not None:
                    leaf_grads[leaf] = g if leaf not in leaf_grads else leaf_grads[leaf].add_(g)

        # Queries: out = (pq kv) r with r = 1 / (pq z + eps).
        for c in _token_chunks(n, ctx.chunk):
            qc, pq = features(ctx.phi_q, q, need_q, c)
            with torch.no_grad():
                pq_ = pq.detach()
                r = torch.matmul(pq_, z[..., None]).add_(ctx.eps).reciprocal_()
                o = torch.matmul(pq_, kv).mul_(r)
                g = grad_out[:, :, c].to(ctx.compute)
                g_num = g * r  # d loss / d (pq kv)
                g_den = torch.linalg.vecdot(g, o)[..., None].mul_(r).neg_()  # d loss / d (pq z)
                d_kv.add_(torch.matmul(pq_.transpose(-1, -2), g_num))
                d_z.add_((pq_ * g_den).sum(-2))
                grad_pq = torch.matmul(g_num, kv.transpose(-1, -2)).add_(g_den * z[:, :, None, :])
            pull(pq, qc, need_q, grad_pq, grad_q, c)
        # Keys and values: kv = sum pk^T v, z = sum pk.
        for c in _token_chunks(n, ctx.chunk):
            kc, pk = features(ctx.phi_k, k, need_k, c, masked=True)
            with torch.no_grad():
                if need_v:
                    grad_v[:, :, c] = torch.matmul(pk.detach(), d_kv)
                grad_pk = torch.matmul(v[:, :, c].to(ctx.compute), d_kv.transpose(-1, -2)).add_(d_z[:, :, None, :])
            pull(pk, kc, need_k, grad_pk, grad_k, c)
        for acc, g in zip(param_grads, scope.pullback(leaf_grads, wanted)):
            if g is not None:
                acc.add_(g)
        grads = iter(param_grads)
        param_out = [next(grads) if need else None for need in need_params]
        return (grad_q, grad_k, grad_v, None, None, None, None, None, *param_out)


def streamed_linear_attention(q, k, v, phi_q, phi_k, params, key_mask=None, eps: float = 1e-6,
                              chunk: int = 1024) -> torch.Tensor:
    """phi_q(q) S / (phi_q(q) z + eps) over chunks of ``chunk`` tokens, for token-wise feature maps.

    ``phi_q`` and ``phi_k`` map [B, H, n, d] to [B, H, n, D] one token at a time;
    ``params`` are the tensors they depend on (their gradients come back through
    autograd). key_mask: bool [B, N], True = real. Returns [B, H, N, d] in v's
    dtype; sums, the division and gradients run in float32 (float64 for float64 inputs). Same values and
    gradients as ``linear_attention.linear_attention(phi_q(q), phi_k(k), v)``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return _StreamedLinearAttention.apply(q, k, v, key_mask, eps, chunk, phi_q, phi_k, *params)
