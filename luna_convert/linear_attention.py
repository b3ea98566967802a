"""The attention math, free of any model: kernel linear attention, its explicit
N x N form (the test reference and the distillation student), and masked
softmax attention (the distillation teacher).

Shapes: q, k, v are [B, H, N, d]; features phi(q), phi(k) are [B, H, N, D];
``key_mask`` is a bool [B, N] with True for real tokens (None: all real).
"""

from __future__ import annotations

import torch

from .kernels import accumulation_dtype, linear_attention_core

EPS = 1e-6


def linear_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None, eps: float = EPS
) -> torch.Tensor:
    """out_i = phi(q_i)^T S / (phi(q_i)^T z + eps), S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j).

    Pads are removed by zeroing phi(k) (not k or v: phi(0) need not be 0).
    Sums and the division run in fp32 even under autocast, so bf16/fp16
    inputs cannot overflow the sums or divide by a rounded-off zero; float64
    inputs stay float64.
    """
    out_dtype, compute = v.dtype, accumulation_dtype(phi_q, phi_k, v)
    with torch.autocast(device_type=v.device.type, enabled=False):
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        if key_mask is not None:
            phi_k = phi_k * key_mask[:, None, :, None].to(phi_k.dtype)
        # S = phi(k)^T v, z = sum_j phi(k_j); out = phi(q) S / (phi(q) z + eps), with a
        # hand-written backward (kernels.linear_attention_core): fewer passes over
        # [N, d] tensors and contiguous gradients for phi(q), phi(k) and v.
        out = linear_attention_core(phi_q, phi_k, v, eps)
    return out.to(out_dtype)


def linear_attention_weights(
    phi_q: torch.Tensor, phi_k: torch.Tensor, key_mask: torch.Tensor | None = None, eps: float = EPS
) -> torch.Tensor:
    """Explicit A_ij = phi(q_i)^T phi(k_j) / (sum_m phi(q_i)^T phi(k_m) + eps), in fp32 (float64 for float64). [B, H, N, N]"""
    compute = accumulation_dtype(phi_q, phi_k)
    scores = torch.einsum("bhnf,bhmf->bhnm", phi_q.to(compute), phi_k.to(compute))
    if key_mask is not None:
        scores = scores * key_mask[:, None, None, :]
    return scores / (scores.sum(-1, keepdim=True) + eps)


def softmax_attention_weights(
    q: torch.Tensor, k: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) over real keys, in fp32 (float64 for float64). [B, H, N, N]"""
    compute = accumulation_dtype(q, k)
    scores = torch.einsum("bhnd,bhmd->bhnm", q.to(compute), k.to(compute)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def attention_distillation_loss(
    teacher: torch.Tensor, student: torch.Tensor, key_mask: torch.Tensor | None = None, eps: float = EPS
) -> torch.Tensor:
    """Row cross-entropy -sum_j a_ij log a^_ij, averaged over heads and real query rows (Hedgehog stage 1)."""
    ce = -(teacher * torch.log(student + eps)).sum(-1)  # [B, H, N]
    if key_mask is None:
        return ce.mean()
    rows = key_mask[:, None, :].expand_as(ce)
    return ce[rows].mean()
