"""Fast evaluation of the LUNA scalar channel bank (see ``feature_maps.ScalarChannels``).

Every channel of the bank,

    psi_l(u) = relu( sum_h w2[l, h] * relu(w1[r, h] * u + b1[r, h]) + b2[l] ),   r = l (or 0 if shared),

is a piecewise-linear function of the scalar u. Hidden unit (r, h) switches at
its knot t = -b1 / w1: for w1 > 0 it is active (w1 u + b1 > 0) when u > t, for
w1 < 0 when u < t, and a unit with w1 == 0 is a constant, active everywhere if
b1 > 0 and nowhere otherwise. Sorting all knots of the bank (K = rows x hidden
of them, at most 512 with the defaults) cuts the real line into K + 1
intervals; on interval k every channel is affine,

    inner_l(u) = slope[k, l] * u + intercept[k, l],

with ``slope[k, l] = sum_h act[k, r, h] w2[l, h] w1[r, h]`` and
``intercept[k, l] = b2[l] + sum_h act[k, r, h] w2[l, h] b1[r, h]`` where
``act[k, r, h]`` says whether unit (r, h) is active on interval k.

So one ``searchsorted`` per scalar (not per channel: the knots of all channels
are merged) and one row gather from a small [K + 1, 2L] table give all L
outputs; nothing of size ``hidden`` is ever expanded per token.

The tables are built with ordinary differentiable torch ops from the four
parameters (a tiny [K + 1, rows, hidden] computation), so their gradients come
from autograd. The per-token part is a custom autograd function whose
backward needs only per-interval sums of ``g`` and ``g * u`` (a histogram over
the interval index, ``index_add_``) plus ``g * slope`` for the input. It saves
u, the int32 interval index and its own output (which the linear attention
downstream keeps alive anyway), never N x M x L x hidden values. Work runs in
cache-sized chunks of tokens.

Numerics: tables are built in float64, evaluation runs in float32 (float64
for float64 inputs) with autocast disabled, and the result has the input's
dtype. At a knot exactly (u == t, a set of measure zero) the value is the same
as the reference's; the subgradient for the parameters of a decreasing unit
(w1 < 0) counts the unit as active there, where ``torch.relu`` would count it
as inactive.
"""

from __future__ import annotations

import torch

# Scalars (tokens x heads x projections) per chunk on the CPU: the chunk's
# [chunk, 2L] gather and [chunk, L] output stay in the L2 cache.
CPU_CHUNK = 1 << 15
GPU_CHUNK = 1 << 22


def channel_tables(psi, dtype: torch.dtype = torch.float64, scale: float = 1.0):
    """Knots and per-interval affine pieces of the channel bank ``psi``.

    Returns ``(knots [K], slope [K + 1, L], intercept [K + 1, L])`` in ``dtype``
    with K = rows * hidden; ``knots`` is sorted ascending (constant units sit
    at +inf at the end) and interval k is ``knots[k-1] < u <= knots[k]``, the
    index ``torch.searchsorted(knots, u)`` returns. slope and intercept are
    differentiable functions of ``psi``'s parameters and include the factor
    ``scale`` (which must be > 0 so that relu commutes with it).
    """
    w1, b1, w2, b2 = (p.to(dtype) for p in (psi.w1, psi.b1, psi.w2, psi.b2))
    rows, hidden = w1.shape
    with torch.no_grad():
        pos, neg = w1 > 0, w1 < 0
        moving = pos | neg
        knot = torch.where(moving, -b1 / torch.where(moving, w1, torch.ones_like(w1)), torch.full_like(w1, float("inf")))
        knots, order = knot.flatten().sort()
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        rank = rank.view(rows, hidden)
        k = torch.arange(knots.numel() + 1, device=w1.device).view(-1, 1, 1)
        act = torch.where(pos, k > rank, torch.where(neg, k <= rank, b1 > 0)).to(dtype)  # [K+1, rows, hidden]
    wa, wc = w2 * w1, w2 * b1  # [L, hidden] (w1/b1 rows broadcast when shared)
    if rows == 1:
        slope = act[:, 0] @ wa.T
        intercept = act[:, 0] @ wc.T + b2
    else:
        slope = torch.einsum("klh,lh->kl", act, wa)
        intercept = torch.einsum("klh,lh->kl", act, wc) + b2
    if scale != 1.0:
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        slope, intercept = slope * scale, intercept * scale
    return knots, slope, intercept


class _PiecewiseLinearReLU(torch.autograd.Function):
    """out[n, l] = relu(slope[idx_n, l] * u_n + intercept[idx_n, l]), idx_n = searchsorted(knots, u_n)."""

    @staticmethod
    def forward(ctx, u, knots, slope, intercept, out_dtype, chunk):
        n, channels = u.numel(), slope.shape[1]
        table = torch.cat([slope, intercept], 1)  # [K+1, 2L]
        out = torch.empty((n, channels), dtype=out_dtype, device=u.device)
        index = torch.empty(n, dtype=torch.int32, device=u.device)
        same = out_dtype == u.dtype
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            uc, ic = u[s:e], index[s:e]
            torch.searchsorted(knots, uc, out_int32=True, out=ic)
            piece = table.index_select(0, ic).view(-1, 2, channels)
            if same:
                oc = out[s:e]
                torch.addcmul(piece[:, 1], uc[:, None], piece[:, 0], out=oc)
                oc.relu_()
            else:
                out[s:e] = torch.addcmul(piece[:, 1], uc[:, None], piece[:, 0]).relu_()
        ctx.chunk = chunk
        ctx.save_for_backward(u, index, slope, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        u, index, slope, out = ctx.saved_tensors
        need_u, _, need_slope, need_intercept = ctx.needs_input_grad[:4]
        need_table = need_slope or need_intercept
        n, channels = out.shape
        grad_u = torch.empty_like(u) if need_u else None
        grad_table = torch.zeros((slope.shape[0], 2 * channels), dtype=u.dtype, device=u.device) if need_table else None
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            uc, ic = u[s:e], index[s:e]
            g = torch.where(out[s:e] > 0, grad_out[s:e].to(u.dtype), 0.0)  # [c, L]
            if need_u:
                torch.linalg.vecdot(g, slope.index_select(0, ic), out=grad_u[s:e])
            if need_table:
                grad_table.index_add_(0, ic, torch.cat([g * uc[:, None], g], 1))
        grad_slope = grad_table[:, :channels] if need_slope else None
        grad_intercept = grad_table[:, channels:] if need_intercept else None
        return grad_u, None, grad_slope, grad_intercept, None, None


def scalar_channels(u: torch.Tensor, psi, scale: float = 1.0) -> torch.Tensor:
    """``scale * psi(u)`` for u [..., M] -> [..., M, L]; same values and gradients as the reference
    ``psi(u)`` (``ScalarChannels.forward``) without expanding the hidden layer.

    Computes in float32 (float64 for float64 input) with autocast off and
    returns u's dtype. ``scale`` (> 0) is folded into the tables for free.
    """
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    chunk = CPU_CHUNK if u.device.type == "cpu" else GPU_CHUNK
    with torch.autocast(device_type=u.device.type, enabled=False):
        knots, slope, intercept = channel_tables(psi, torch.float64, scale)
        flat = u.reshape(-1).to(compute).contiguous()
        out = _PiecewiseLinearReLU.apply(
            flat, knots.to(compute), slope.to(compute), intercept.to(compute), u.dtype, chunk
        )
    return out.view(*u.shape, slope.shape[1])
