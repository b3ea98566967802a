"""Additive sorting kernels: Rux, Hertrich & Neumayer, "additive kernels constructed from univariate
spline and polynomial exponential kernels ... quasi linear computation via sorting" (seed abstract).

Per head, R learned 1-D projections a_r shared by queries and keys, x_ir = a_r.q_i, y_jr = a_r.k_j:

    k(q_i, k_j) = c0 + sum_r w_r kappa((x_ir - y_jr) / h_r)
    out_i = sum_j m_j k(q_i, k_j) v_j / (sum_j m_j k(q_i, k_j) + eps)      (m_j: the key mask)

with kappa the Laplace profile exp(-|t|) or the polynomial-exponential PE_1 (Matern-3/2)
(1 + |t|) exp(-|t|). The kernel does not factor into finite features; per projection it is summed
in O(N log N): sort the keys' projections, run decayed prefix sums left to right and right to left
(:func:`decayed_prefix_sums`), and read each query's two neighbours found with ``searchsorted``.
Every exponent in those sums is <= 0 (a block-local reference point is subtracted before
exponentiating), so no projection, however large, can overflow.

For float32 on the CPU (eager), ``sorting_native`` runs the same sums as native passes, forward and
backward: a radix sort per projection, two sequential scans (M_p = e^{-(y_p - y_{p-1})} M_{p-1} + u_p)
and a merge walk over the sorted queries. The PyTorch path below is their reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.context import AttentionContext
from ..ops.dtypes import accumulation_dtype
from . import sorting_native
from .base import KernelAttention, Method
from .sorting_options import PROFILES, SortingOptions  # noqa: F401 (PROFILES: read here too)
from .registry import register

SCAN_BLOCK = 32  # tokens per block of the scan: a block is summed with an explicit [C, C] decay matrix


def inverse_softplus(value: float) -> float:
    return value + math.log(-math.expm1(-value))


def _block_sums(y: torch.Tensor, a0: torch.Tensor, a1: torch.Tensor | None, moments: bool):
    """Within blocks: M0_p = sum_{j<=p} e^{-(y_p-y_j)} a0_j and M1_p = sum_{j<=p} e^{-(y_p-y_j)}((y_p-y_j) a0_j + a1_j).

    y [..., S, C] ascending within each block, a0/a1 [..., S, C, c]."""
    gap = y[..., :, None] - y[..., None, :]  # [..., S, C, C], gap[p, j] = y_p - y_j >= 0 for j <= p
    lower = torch.ones(gap.shape[-2:], dtype=torch.bool, device=y.device).tril()
    gap = gap.masked_fill(~lower, 0.0)
    decay = torch.exp(-gap).masked_fill(~lower, 0.0)  # <= 1: cannot overflow
    m0 = decay @ a0
    if not moments:
        return m0, None
    m1 = (gap * decay) @ a0
    if a1 is not None:
        m1 = m1 + decay @ a1
    return m0, m1


def decayed_prefix_sums(y: torch.Tensor, a0: torch.Tensor, a1: torch.Tensor | None = None, moments: bool = False,
                        block: int = SCAN_BLOCK):
    """For ascending y [..., N] and a0 [..., N, c]: M0_p = sum_{j<=p} exp(-(y_p - y_j)) a0_j, and with
    ``moments`` also M1_p = sum_{j<=p} exp(-(y_p - y_j)) ((y_p - y_j) a0_j + a1_j) (a1 None: 0).

    Blocks of ``block`` points are summed explicitly; the blocks' totals are carried across blocks
    by the same function one level up (so O(N block) work, a few levels deep). Every exponent is a
    difference of sorted values relative to a point at or before it: <= 0, so stable for any y.
    """
    n = y.shape[-1]
    if n <= block:
        one_block = _block_sums(y[..., None, :], a0[..., None, :, :], None if a1 is None else a1[..., None, :, :],
                                moments)
        return tuple(None if t is None else t[..., 0, :, :] for t in one_block)
    blocks = -(-n // block)
    pad = blocks * block - n
    if pad:  # pads after the last point with weight 0 leave every earlier prefix unchanged
        y = torch.cat([y, y[..., -1:].expand(*y.shape[:-1], pad)], -1)
        a0 = F.pad(a0, (0, 0, 0, pad))
        a1 = None if a1 is None else F.pad(a1, (0, 0, 0, pad))
    yb = y.reshape(*y.shape[:-1], blocks, block)
    split = lambda t: None if t is None else t.reshape(*t.shape[:-2], blocks, block, t.shape[-1])  # noqa: E731
    m0, m1 = _block_sums(yb, split(a0), split(a1), moments)
    ends = yb[..., -1]  # [..., S]: each block's last (largest) point
    carry0, carry1 = decayed_prefix_sums(ends, m0[..., -1, :], None if m1 is None else m1[..., -1, :], moments, block)
    # Block s receives the carry of blocks < s, referenced at the end of block s - 1.
    shift = lambda t: F.pad(t[..., :-1, :], (0, 0, 1, 0))  # noqa: E731
    previous_end = torch.cat([yb[..., :1, 0], ends[..., :-1]], -1)  # block 0 has no carry: any point <= its own
    delta = yb - previous_end[..., None]  # >= 0
    decay = torch.exp(-delta)[..., None]
    m0 = m0 + decay * shift(carry0)[..., None, :]
    if moments:
        m1 = m1 + decay * (delta[..., None] * shift(carry0)[..., None, :] + shift(carry1)[..., None, :])
    merge = lambda t: None if t is None else t.reshape(*t.shape[:-3], blocks * block, t.shape[-1])[..., :n, :]  # noqa: E731
    return merge(m0), merge(m1)


def profile_kernel(t: torch.Tensor, profile: str) -> torch.Tensor:
    """kappa(t) for the explicit N x N form."""
    a = t.abs()
    return torch.exp(-a) if profile == "laplace" else (1 + a) * torch.exp(-a)


def sorted_kernel_sums(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor, profile: str,
                       block: int = SCAN_BLOCK) -> torch.Tensor:
    """sum_j kappa(x_i - y_j) u_j for every i, in O(N log N): x [..., Nq], y [..., N], u [..., N, c]."""
    moments = profile == "matern32"
    y_sorted, order = torch.sort(y, dim=-1)
    u_sorted = u.gather(-2, order[..., None].expand_as(u))
    left0, left1 = decayed_prefix_sums(y_sorted, u_sorted, moments=moments, block=block)
    # Right to left: the same sums over the mirrored points -y (ascending after the flip).
    right0, right1 = decayed_prefix_sums(-y_sorted.flip(-1), u_sorted.flip(-2), moments=moments, block=block)
    right0, right1 = right0.flip(-2), None if right1 is None else right1.flip(-2)
    n = y.shape[-1]
    y_sorted, x = y_sorted.contiguous(), x.contiguous()

    def side(at, gap_sign, sums0, sums1, present):
        gap = gap_sign * (x - y_sorted.gather(-1, at))  # >= 0 where the neighbour exists
        gap = torch.where(present[..., 0], gap, torch.zeros_like(gap))[..., None]
        pick = lambda s: s.gather(-2, at[..., None].expand(*at.shape, s.shape[-1]))  # noqa: E731
        value = (1 + gap) * pick(sums0) + pick(sums1) if moments else pick(sums0)
        return torch.where(present, torch.exp(-gap) * value, torch.zeros_like(value))

    def split_at(above):  # the sums with the keys at sorted positions < above on the left
        has_left, has_right = (above > 0)[..., None], (above < n)[..., None]
        left_at, right_at = (above - 1).clamp_min(0), above.clamp_max(n - 1)
        return side(left_at, 1, left0, left1, has_left) + side(right_at, -1, right0, right1, has_right)

    sums = split_at(torch.searchsorted(y_sorted, x, right=True))  # keys <= x_i on the left
    if moments:  # (1 + |t|) e^-|t| has slope 0 at t = 0 from either side
        return sums
    # Laplace's e^-|t| has a kink at 0: a key tied with x_i counted on the left has slope -1, on the right +1. The
    # mean of both splits has the same value and the explicit form's slope 0 at ties (|t|' = sign(t) = 0 there).
    return 0.5 * (sums + split_at(torch.searchsorted(y_sorted, x, right=False)))


class SortingKernelAttention(KernelAttention):
    """The additive sorting kernel of one layer: projections [H, d, R], weights, bandwidths, background."""

    options_class = SortingOptions

    def __init__(self, head_dim: int, num_heads: int, options: SortingOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        o = self.options
        r = o.projections
        # Random orthonormal directions (blocks of d when R > d): the "sliced" initialisation of the notes.
        blocks = [torch.linalg.qr(torch.randn(num_heads, head_dim, head_dim))[0] for _ in range(-(-r // head_dim))]
        self.proj = nn.Parameter(torch.cat(blocks, -1)[..., :r].contiguous())  # [H, d, R]
        self.raw_weight = nn.Parameter(torch.full((num_heads, r), inverse_softplus(1.0 / r)))
        self.min_bandwidth = 1e-2 * o.bandwidth
        self.raw_bandwidth = nn.Parameter(torch.full((num_heads, r), inverse_softplus(o.bandwidth - self.min_bandwidth)))
        self.raw_background = nn.Parameter(torch.full((num_heads,), inverse_softplus(o.background)))
        self.block = SCAN_BLOCK

    def kernel_parameters(self, dtype: torch.dtype):
        """w [H, R], h [H, R] and c0 [H] as positive numbers in ``dtype``."""
        w = F.softplus(self.raw_weight.to(dtype))
        h = F.softplus(self.raw_bandwidth.to(dtype)) + self.min_bandwidth
        return w, h, F.softplus(self.raw_background.to(dtype))

    def projected(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype):
        """x = a_r.q / h_r and y = a_r.k / h_r laid out [B, H, R, N] (sorted dimension last), with w and c0."""
        w, h, c0 = self.kernel_parameters(dtype)
        proj_t = (self.proj.to(dtype) / h[:, None, :]).transpose(1, 2)  # [H, R, d]
        if q.shape == k.shape:  # self-attention: one product for both, [2, B, H, R, N], each half contiguous
            x, y = torch.matmul(proj_t, torch.stack([q, k]).to(dtype).transpose(-1, -2)).unbind(0)
        else:
            x, y = (torch.matmul(proj_t, t.to(dtype).transpose(-1, -2)) for t in (q, k))
        return x, y, w, c0

    def weights(self, q, k, key_mask=None, context: AttentionContext | None = None):
        compute = accumulation_dtype(q, k)
        with torch.autocast(device_type=q.device.type, enabled=False):
            x, y, w, c0 = self.projected(q, k, compute)
            kernel = profile_kernel(x[..., :, None] - y[..., None, :], self.options.profile)  # [B, H, R, N, N]
            kernel = torch.einsum("bhrnm,hr->bhnm", kernel, w) + c0[:, None, None]
            if key_mask is not None:
                kernel = kernel * key_mask[:, None, None, :]
            return kernel / (kernel.sum(-1, keepdim=True) + self.options.eps)

    def forward(self, q, k, v, key_mask=None, context: AttentionContext | None = None):
        compute = accumulation_dtype(q, k, v)  # fp32 before sorting: bf16 ties would lose the order
        with torch.autocast(device_type=q.device.type, enabled=False):
            x, y, w, c0 = self.projected(q, k, compute)
            if sorting_native.applies(x, y, v, w, c0):  # sorts, scans and merges in C (float32, CPU)
                out = sorting_native.sorting_kernel_attention(x, y, v.to(compute), key_mask, w, c0,
                                                              self.options.profile == "matern32", self.options.eps)
                return out.to(v.dtype)
            b, heads, r, n = y.shape
            u = torch.cat([v.to(compute), torch.ones_like(v[..., :1], dtype=compute)], -1)  # [B, H, N, dv + 1]
            if key_mask is not None:
                u = u * key_mask[:, None, :, None]  # pads weigh exactly 0 (they still take part in the sort)
            sums = sorted_kernel_sums(x, y, u[:, :, None].expand(b, heads, r, n, u.shape[-1]),
                                      self.options.profile, self.block)  # [B, H, R, N, dv + 1]
            total = torch.einsum("bhrnc,hr->bhnc", sums, w) + c0[:, None, None] * u.sum(-2, keepdim=True)
            out = total[..., :-1] / (total[..., -1:] + self.options.eps)
        return out.to(v.dtype)


SORTING = register(Method(
    name="sorting", core=SortingKernelAttention, distill=True,
    description="Additive sorting kernels: sum_r w_r kappa((a_r.q - a_r.k)/h_r), O(N log N) by sorting "
                "(Rux, Hertrich & Neumayer)",
    paper="Rux, Hertrich & Neumayer, additive sorting kernels (abstract only); the sorting summation of "
          "Hertrich 2024, Fast Kernel Summation in High Dimensions via Slicing and Fourier Transforms",
    details="""Confirmed (abstract only): additive kernels of univariate spline / polynomial-exponential profiles,
infinite capacity, quasi-linear computation via sorting. Confirmed (Hertrich's sliced_kernel_fastsum code):
1-D kernel sums by torch.sort + cumulative sums. Derived, every choice an option or stated here:
k(q, k) = c0 + sum_r w_r kappa((a_r.q - a_r.k)/h_r) with the same R projections for q and k (option
projections, 16), w_r = softplus, h_r = softplus + 1e-2 h_init (option bandwidth), c0 = softplus
(option background); kappa 'laplace' exp(-|t|) or 'matern32' (1+|t|)exp(-|t|) (option profile); the
splines of the abstract are not offered (global prefix sums of y^b cancel catastrophically); projections
random orthonormal at init (not PCA: no calibration batch at conversion); no q scaling; rows divided by
the kernel row sum + eps over real keys; pads weigh 0. Exact decayed prefix sums in both directions over
the sorted keys, blocks of 32 with a block-local reference (every exponent <= 0); in float32 on the CPU
native passes of sorts, scans and a merge, forward and backward (sorting_native). Recipe (derived):
distil attention against softmax through the explicit N x N weights, then finetune.""",
))
