"""Sliding-window softmax + linear attention in one layer (LoLCATs-style), linear in N for a fixed window.

Per batch, head and query i, with s_ij = scale q_i . k_j, the window W(i) = {j real : |i - j| <= w},
c_i = max over W(i) of s_ij (0 for an empty window) and a per-head factor gamma:

    a_ij = exp(s_ij - c_i)               j in W(i)
    a_ij = gamma phi(q_i) . phi(k_j)     j real, outside W(i)
    a_ij = 0                             j a pad
    out_i = sum_j a_ij v_j / (sum_j a_ij + eps)     (``clamp``: / max(sum_j a_ij, eps))

Its naive reference is ``reference.windowed_linear_attention_weights(...) @ v``.

How: gamma times linear attention's sums over every real key (S = phi_k^T v, z = phi_k^T 1), plus a
correction on the band only, exp(s_ij - c_i) - gamma phi(q_i) . phi(k_j) for j in W(i). The band is
computed in blocks: queries in blocks of ``block`` >= w tokens, each block against the keys of its own
block and its two neighbours (every key of a window lies there), so the largest tensors are the
[.., N / block, block, 3 block] scores and the neighbour keys [.., N / block, 3 block, D]: O(N w D) work
and memory. Plain autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dtypes import accumulation_dtype
from .reference import EPS, window_stabiliser


def block_size(window: int, tokens: int) -> int:
    """Queries per block: the window's half-width (so a window spans at most the two neighbour
    blocks), no more than the sequence."""
    return max(1, min(window, tokens))


def neighbour_blocks(x: torch.Tensor, block: int, blocks: int) -> torch.Tensor:
    """[..., N, C] -> [..., blocks, 3 block, C]: for each query block, the tokens of the block before it,
    itself and the block after it (zeros beyond the sequence)."""
    padded = F.pad(x, (0, 0, block, blocks * block - x.shape[-2] + block))  # [..., (blocks + 2) block, C]
    return padded.unfold(-2, 3 * block, block).transpose(-1, -2)  # unfold puts the window last


def query_blocks(x: torch.Tensor, block: int, blocks: int) -> torch.Tensor:
    """[..., N, C] -> [..., blocks, block, C], zero rows after the last token."""
    padded = F.pad(x, (0, 0, 0, blocks * block - x.shape[-2]))
    return padded.unflatten(-2, (blocks, block))


def band_mask(key_mask: torch.Tensor | None, batch: int, tokens: int, window: int, block: int,
              blocks: int, device: torch.device) -> torch.Tensor:
    """bool [B, 1, blocks, block, 3 block]: key m of a query block's neighbourhood is in query r's window
    (|i - j| <= window) and a real key of the sequence."""
    rows = torch.arange(block, device=device)[:, None]  # query r of a block sits at i = t block + r
    cols = torch.arange(3 * block, device=device)[None, :]  # key m of its neighbourhood at j = (t - 1) block + m
    near = (cols - block - rows).abs() <= window  # j - i = m - block - r, the same for every block
    real = torch.ones(batch, tokens, dtype=torch.bool, device=device) if key_mask is None else key_mask.bool()
    real_keys = neighbour_blocks(real[:, :, None], block, blocks)[..., 0]  # [B, blocks, 3 block], False beyond N
    return (near & real_keys[:, :, None, :])[:, None]


def band_weights(q, k, phi_q, phi_k, gamma, in_window, scale: float, block: int, blocks: int,
                 covered: torch.Tensor) -> torch.Tensor:
    """The band's correction, exp(s_ij - c_i) - gamma phi(q_i) . phi(k_j) for j in W(i), 0 elsewhere:
    [B, H, blocks, block, 3 block]; rows ``covered`` [B, 1, blocks, block] (every real key in the window) take
    no linear term at all, so no cancellation (``windowed_linear_attention``)."""
    scores = query_blocks(q, block, blocks) @ neighbour_blocks(k, block, blocks).transpose(-1, -2) * scale
    scores = scores.masked_fill(~in_window, float("-inf"))  # exp gives 0 outside the window, gradients stay finite
    stabiliser = window_stabiliser(scores)
    kernel = query_blocks(phi_q, block, blocks) @ neighbour_blocks(phi_k, block, blocks).transpose(-1, -2)
    return torch.exp(scores - stabiliser) - (gamma * kernel).masked_fill(~in_window | covered[..., None], 0.0)


def windowed_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor,
    gamma: torch.Tensor, window: int, scale: float, key_mask: torch.Tensor | None = None, eps: float = EPS,
    clamp: bool = False,
) -> torch.Tensor:
    """Softmax within |i - j| <= ``window`` of each query, gamma x linear attention outside it, one
    normalisation (the module docstring's formula). q, k, v [B, H, N, d]; phi_q, phi_k [B, H, N, D];
    gamma [H] (the per-head mixing factor, positive); key_mask bool [B, N] (None: all real).

    Sums and the division run in fp32 for half-precision inputs (float64 stays float64), as ``ops.linear``.
    """
    if window < 1:
        raise ValueError(f"window must be a positive integer here, got {window!r}")
    out_dtype, compute = v.dtype, accumulation_dtype(q, k, v, phi_q, phi_k)
    batch, heads, tokens, d = v.shape
    block = block_size(window, tokens)
    blocks = -(-tokens // block)
    with torch.autocast(device_type=v.device.type, enabled=False):
        q, k, v, phi_q, phi_k = (t.to(compute) for t in (q, k, v, phi_q, phi_k))
        gamma = gamma.to(compute).view(1, heads, 1, 1)
        # Values with a ones column: every product below gives numerator and denominator together.
        v_ones = F.pad(v, (0, 1), value=1.0)
        if key_mask is not None:
            v_ones = v_ones * key_mask.view(batch, 1, tokens, 1)  # pad keys leave the sums
        far = gamma * (phi_q @ (phi_k.transpose(-1, -2) @ v_ones))  # gamma [phi_q S | phi_q z]   [B, H, N, d + 1]
        in_window = band_mask(key_mask, batch, tokens, window, block, blocks, v.device)
        # Rows whose window holds every real key are exact softmax: adding the linear sums over all keys and
        # taking the band's back cancelled in float32 (LLoPS's kernel values dwarf exp(s - c) <= 1: 0.35 of the
        # output's scale off at x5 q, k, tests/test_numerics.py), so those rows take neither.
        real = tokens if key_mask is None else key_mask.sum(-1).view(batch, 1, 1, 1)
        covered = in_window.sum(-1) == real  # [B, 1, blocks, block]
        far = far.masked_fill(covered.flatten(-2)[..., :tokens, None], 0.0)
        weights = band_weights(q, k, phi_q, phi_k, gamma[..., None], in_window, scale, block, blocks, covered)
        near = (weights @ neighbour_blocks(v_ones, block, blocks)).flatten(-3, -2)[..., :tokens, :]
        num_den = far + near
        num, den = num_den[..., :d], num_den[..., d:]
        out = num / (den.clamp_min(eps) if clamp else den + eps)
    return out.to(out_dtype)
