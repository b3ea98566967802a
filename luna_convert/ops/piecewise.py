"""Piecewise-linear functions of a scalar in standard operators: relu(slope[i] u + intercept[i]), i the number
of sorted knots below u, for every element u of a tensor and L functions at once.

Every step is an operator that eager PyTorch, Inductor (CPU and CUDA), torch.export and ONNX Runtime all have
(arithmetic, comparisons, gathers of single values: :func:`take`), so one form runs wherever a model runs. Two ways find i, both
exact for the same knots (the reference, :func:`piecewise_relu_reference`, takes ``torch.searchsorted``):

- :class:`KnotGrid`, built from the knots' values: the cell of u in a grid of equal cells (arithmetic), then
  one comparison with each of the at most ``depth`` distinct knots that cell holds (usually one): 1 + depth
  gathers per element. Eager code and compiled graphs reach it through the registered operator
  :func:`knot_intervals` (a grid's size depends on the knots' values, which a graph's shapes cannot); an
  export takes one built before it, as constants of the graph.
- :func:`binary_search`: a branchless search, ceil(log2(K + 1)) gathers and comparisons per element, with no
  data-dependent shape, for an exported graph without a grid built before it and for knots that crowd every
  grid. (Compiled, it ran the layer 2.5x slower than the operator: docs/design-decisions.md.)

The table is ``[R, 2L]``, row r = [slope | intercept] of the L functions on interval r (interval r holds the u
with knots[r - 1] < u <= knots[r]); gradients reach it through the gathers, and u's gradient is the slope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .normalize import sum_reciprocal

# A grid gives up (the binary search serves instead) where some cell would hold more distinct knots than this
# even at the largest grid: each one more is a gather and a comparison for every element.
MAX_DEPTH = 4
MAX_CELLS = 1 << 14
# Eager steps over many values go in chunks of this many: each step's buffers stay in cache and are reused,
# where steps over a whole [B, H, N, M] tensor map fresh pages from glibc on every call (the knot search at
# 4,096 tokens: about 24k page faults a layer call, most of its time; docs/design-decisions.md).
CHUNK_VALUES = 1 << 16


def index_dtype() -> torch.dtype:
    """The dtype of the indices :func:`take` takes: int32 (half the memory) except in an exported graph, whose
    ``torch.gather`` needs int64."""
    return torch.int64 if torch.compiler.is_exporting() else torch.int32


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for a 1-D ``values`` and a 1-D ``index`` (of :func:`index_dtype`).

    ``index_select`` in eager and compiled code (3x faster than ``torch.gather`` in eager PyTorch on a CPU),
    ``torch.gather`` in an exported graph: ONNX Runtime runs the first as Gather, 9 ns an element, the second
    as GatherElements, 1.2 ns (one thread, 786k elements; docs/design-decisions.md)."""
    if torch.compiler.is_exporting():
        return torch.gather(values, 0, index)
    return values.index_select(0, index)


def piecewise_relu(u: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """relu(slope[index] * u + intercept[index]): u [...], ``index`` the table row of every element (u's shape,
    of :func:`index_dtype`), table [R, 2L] -> [..., L]; differentiable in u and the table (plain autograd: a
    hand-written backward saving only u, the index and the output ran 2x slower eager and 5x compiled, one
    thread, 4,096 tokens, for about a third less saved memory)."""
    return torch.stack(piecewise_relu_channels(u, table, index), -1)


def piecewise_relu_channels(u: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
    """:func:`piecewise_relu` as its L channels, each of u's shape: what a caller that works on one channel at a
    time (a sum over u's last axis) takes before it stacks them."""
    flat, channels = index.reshape(-1), table.shape[1] // 2
    # channel by channel: gathers of single values, which Inductor vectorises better than rows of 2L
    return [torch.relu(torch.addcmul(take(table[:, channels + l], flat).view(u.shape),
                                     take(table[:, l], flat).view(u.shape), u))
            for l in range(channels)]


def piecewise_relu_reference(u: torch.Tensor, knots: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """:func:`piecewise_relu` with i = ``torch.searchsorted(knots, u)``: the plain form the fast ones must equal."""
    index = torch.searchsorted(knots.to(u.dtype), u.detach().contiguous())
    channels = table.shape[1] // 2
    return torch.relu(table[index, :channels] * u[..., None] + table[index, channels:])


def binary_search(u: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """The number of ``knots`` (sorted, [K]) below each element of the 1-D u (:func:`index_dtype`; NaN -> 0).

    The knots are padded with +inf to 2^s - 1; at step s the search compares u with the knot that halves what
    is left, a gather and a comparison, with no branch and no data-dependent shape.
    """
    steps = knots.numel().bit_length()
    padded = torch.cat([knots, knots.new_full(((1 << steps) - 1 - knots.numel(),), math.inf)])
    index = torch.zeros(u.shape, dtype=index_dtype(), device=u.device)
    for step in reversed(range(steps)):
        half = 1 << step
        index = index + (u > take(padded, index + (half - 1))).to(index.dtype) * half
    return index


def _cells(x: torch.Tensor, squashed: bool, low: float, scale: float, cells: int) -> torch.Tensor:
    """The grid cell (:func:`index_dtype`) of every element of x: a monotone map, so a knot in a lower cell than u is below
    u. "Squashed" grids take x / (1 + |x|) first (knots spread over many magnitudes: a random init's -b1/w1).
    Knots and inputs take the very same float operations. NaN lands in cell 0 (its features stay NaN)."""
    if squashed:
        x = x / (x.abs().clamp(max=1e30) + 1)  # +-inf -> +-inf, not NaN
    cell = (x - low).mul_(scale).clamp_(0, cells - 1).to(index_dtype())
    return cell.clamp_(0, cells - 1)  # NaN casts to an arbitrary integer


@dataclass(frozen=True)
class KnotGrid:
    """Where each element falls among sorted knots, from a grid of equal cells built from the knots' values.

    ``cell_knots`` [depth, cells]: the distinct knots of each cell, ascending, padded with +inf; ``rows``
    [cells * (depth + 1)]: for cell c and j knots of it below u, the table row ``rows[c * (depth + 1) + j]``.
    """

    squashed: bool
    low: float
    scale: float
    cells: int
    cell_knots: torch.Tensor
    rows: torch.Tensor

    @property
    def depth(self) -> int:
        return self.cell_knots.shape[0]

    @staticmethod
    def build(knots: torch.Tensor) -> "KnotGrid | None":
        """The grid of the sorted knots [K] (table rows 0..K), in their dtype; None where every grid crowds."""
        finite = knots[torch.isfinite(knots)]
        distinct, counts = torch.unique_consecutive(finite, return_counts=True)
        # the table row of u just above each distinct knot: the knots at or below it (-inf ones always are,
        # +inf ones never)
        below = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]) + int((knots == -math.inf).sum())
        if distinct.numel() == 0:
            return KnotGrid(False, 0.0, 0.0, 1, knots.new_empty(0, 1), below.to(torch.int32))
        low, high = float(distinct[0]), float(distinct[-1])
        plain_ok = math.isfinite(high - low) and high > low
        best = None  # (depth, cells, squashed, low, scale, cell): the fewest comparisons, then the fewest cells
        for squashed in ((False, True) if plain_ok else (True,)):
            lo, span = (-1.0, 2.0) if squashed else (low, high - low)
            cells = max(64, 1 << math.ceil(math.log2(4 * distinct.numel())))
            while True:
                scale = cells / span
                cell = _cells(distinct, squashed, lo, scale, cells)
                depth = int(torch.bincount(cell, minlength=cells).max())
                if depth <= 1 or cells >= MAX_CELLS:
                    break
                cells = min(4 * cells, MAX_CELLS)
            if best is None or depth < best[0]:
                best = depth, cells, squashed, lo, scale, cell
        depth, cells, squashed, lo, scale, cell = best
        if depth <= MAX_DEPTH:
            return KnotGrid._from_cells(distinct, below, cell, squashed, lo, scale, cells, depth)
        return None

    @staticmethod
    def _from_cells(distinct, below, cell, squashed, low, scale, cells, depth) -> "KnotGrid":
        per_cell = torch.bincount(cell, minlength=cells)
        first = torch.cumsum(per_cell, 0) - per_cell  # index in ``distinct`` of each cell's first knot
        slot = torch.arange(distinct.numel(), device=cell.device) - first[cell]
        cell_knots = distinct.new_full((depth, cells), math.inf)
        cell_knots[slot, cell] = distinct
        # rows[c, j]: below j of the cell's knots, the table row after the first first[c] + j distinct knots
        # (``below``); j beyond the cell's count is never reached (u > +inf is false)
        n = (first[:, None] + torch.arange(depth + 1, device=cell.device)).clamp(max=distinct.numel())
        return KnotGrid(squashed, low, scale, cells, cell_knots, below[n].reshape(-1).to(torch.int32))

    def index(self, u: torch.Tensor) -> torch.Tensor:
        """The table row of every element of the 1-D u (:func:`index_dtype`): the cell's base row, plus the
        cell's knots below."""
        cell = _cells(u, self.squashed, self.low, self.scale, self.cells)
        index = cell * (self.depth + 1) if self.depth else cell
        for knots in self.cell_knots.unbind(0):
            index += u > take(knots, cell)
        return index

    def rows_of(self, table: torch.Tensor) -> torch.Tensor:
        """The grid's table, [cells * (depth + 1), 2L]: ``table``'s rows in the grid's order (differentiable)."""
        return table.index_select(0, self.rows.to(table.device))


# The grids of recent knot vectors (their bytes -> grid, the latest used last): every layer's bank of a large
# model, queries and keys, forward and backward, without rebuilding one per call.
_GRIDS: dict = {}
_GRIDS_KEPT = 128


def knot_grid(knots: torch.Tensor) -> "KnotGrid | None":
    """The grid of the sorted ``knots`` (``KnotGrid.build``), cached by their values; None where every grid
    crowds (the binary search serves instead)."""
    key = (knots.dtype, knots.device, knots.detach().cpu().numpy().tobytes())
    if key in _GRIDS:
        _GRIDS[key] = grid = _GRIDS.pop(key)
        return grid
    grid = KnotGrid.build(knots.detach())
    while len(_GRIDS) >= _GRIDS_KEPT:
        _GRIDS.pop(next(iter(_GRIDS)))
    _GRIDS[key] = grid
    return grid


@torch.library.custom_op("luna_convert::knot_intervals", mutates_args=())
def knot_intervals(u: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """The number of ``knots`` (sorted [K], u's dtype) below each element of u (int32, u's shape; NaN -> 0).

    A registered operator so that compiled graphs call it as eager code does: its grid (``KnotGrid``) depends
    on the knots' values, which a graph's shapes cannot; it has no gradient (an index). Where the knots crowd
    every grid, the binary search.
    """
    flat = u.detach().reshape(-1)
    grid = knot_grid(knots)
    if grid is None:
        return binary_search(flat, knots.detach()).view(u.shape)
    out = torch.empty(flat.shape, dtype=torch.int32, device=u.device)
    for start in range(0, flat.numel(), CHUNK_VALUES):  # the steps' buffers stay in cache
        torch.index_select(grid.rows, 0, grid.index(flat[start:start + CHUNK_VALUES]),
                           out=out[start:start + CHUNK_VALUES])
    return out.view(u.shape)


def piecewise_relu_in_chunks(x: torch.Tensor, table_t: torch.Tensor, rows_of: Callable[[torch.Tensor], torch.Tensor],
                             norm_eps: float | None) -> torch.Tensor:
    """relu(slope u + intercept) [..., M, L] of every element u of x [..., M] without autograd, each channel
    divided by its sum over the M elements + ``norm_eps`` where given: in chunks of whole tokens
    (``CHUNK_VALUES``), the L channels computed channel-major (with L innermost the steps ran unvectorised) and
    normalised, then written interleaved into the output. ``table_t`` [2L, R]: the table transposed (slopes,
    then intercepts); ``rows_of(chunk)``: the table column of each element of a 1-D chunk."""
    channels, m = table_t.shape[0] // 2, x.shape[-1]
    out = x.new_empty(*x.shape, channels)
    flat, tokens_out = x.reshape(-1), out.view(-1, m, channels)
    step = max(1, CHUNK_VALUES // m) * m
    for start in range(0, flat.numel(), step):
        chunk = flat[start:start + step]
        rows = table_t.index_select(1, rows_of(chunk))  # [2L, c]: the slopes, then the intercepts
        values = torch.addcmul(rows[channels:], rows[:channels], chunk).relu_().view(channels, -1, m)
        if norm_eps is not None:
            values.mul_(sum_reciprocal(values, -1, norm_eps))
        tokens_out[start // m:(start + step) // m].copy_(values.permute(1, 2, 0))
    return out


def piecewise_relu_features(u: torch.Tensor, knots: torch.Tensor, table: torch.Tensor,
                            norm_eps: float | None) -> torch.Tensor:
    """:func:`piecewise_relu` of u [..., M] (float) by the sorted ``knots`` [K] and ``table`` [K + 1, 2L], each
    channel divided by its sum over M + ``norm_eps`` where given: [..., M, L], for inference (no gradient).
    :func:`piecewise_relu_in_chunks` over the knots' grid, or the binary search where the knots crowd every
    grid.

    Compiled graphs call it as the registered operator ``luna_convert::piecewise_relu_features``: Inductor's own
    kernel for these gathers ran 2.5x slower than the chunks (4,096 tokens, one thread; docs/design-decisions.md).
    Eager code calls it directly: an operator's first eager call imports torch's fake-tensor stack (~160 MB)."""
    if torch.compiler.is_compiling():
        return _piecewise_relu_features_op(u, knots, table, -1.0 if norm_eps is None else float(norm_eps))
    knots, table = knots.detach(), table.detach()
    grid = knot_grid(knots)
    if grid is None:
        table_t, rows_of = table.t().contiguous(), lambda chunk: binary_search(chunk, knots)
    else:
        table_t, rows_of = grid.rows_of(table).t().contiguous(), grid.index
    return piecewise_relu_in_chunks(u.detach(), table_t, rows_of, norm_eps)


def piecewise_relu_features_reference(u: torch.Tensor, knots: torch.Tensor, table: torch.Tensor,
                                      norm_eps: float | None) -> torch.Tensor:
    """:func:`piecewise_relu_features` in plain form: :func:`piecewise_relu_reference`, then each channel divided
    by its sum over M + ``norm_eps``."""
    features = piecewise_relu_reference(u, knots, table)
    return features if norm_eps is None else features / (features.sum(-2, keepdim=True) + norm_eps)


@torch.library.custom_op("luna_convert::piecewise_relu_features", mutates_args=())
def _piecewise_relu_features_op(u: torch.Tensor, knots: torch.Tensor, table: torch.Tensor,
                                norm_eps: float) -> torch.Tensor:
    """:func:`piecewise_relu_features` as an operator (``norm_eps`` < 0: no norm); no autograd (inference)."""
    return piecewise_relu_features(u, knots, table, None if norm_eps < 0 else norm_eps)


@_piecewise_relu_features_op.register_fake
def _piecewise_relu_features_shape(u, knots, table, norm_eps):
    return u.new_empty((*u.shape, table.shape[1] // 2))


def knot_intervals_reference(u: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """``luna_convert::knot_intervals`` in one PyTorch call (NaN past every knot here, where the operator
    puts it in the first interval)."""
    return torch.searchsorted(knots, u.contiguous(), out_int32=True)


@knot_intervals.register_fake
def _knot_intervals_shape(u, knots):
    return u.new_empty(u.shape, dtype=torch.int32)
